"""The built-in benchmark behind `python -m remat`; never imported by the library itself."""
