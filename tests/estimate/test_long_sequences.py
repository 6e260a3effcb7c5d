"""`remat.estimate` at long sequences (NOTE [ Long-sequence configurations ], NOTE [ Searching the largest batch ]):
the head, tiles and per-block offload as configurations, each checked against a real step; the longest sequence
from a few estimates where the peak is affine in the sequence, the bisection where it is not; and the command
line's errors on one line.
"""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat._estimate import largest_batch as _largest
from remat._estimate import predict as _predict
from remat._estimate.long_sequences import split_extras
from remat._sites.tiles import tile_blocks

WIDTH = 32


class Block(nn.Module):
    """A norm and a wide MLP over (batch, seq, width): its intermediates dominate a step's activations."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 8 * WIDTH), nn.GELU(), nn.Linear(8 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Quadratic(nn.Module):
    """A block that keeps a seq x seq tensor (attention weights): its peak is not affine in the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = (self.proj(x) @ x.transpose(1, 2)).softmax(-1)
        return x + weights @ x


def stack(block: type[nn.Module] = Block, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(depth)])


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def real_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The whole step's peak (parameters and the input included), gradients made by backward, no optimizer."""
    before = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])
    for parameter in model.parameters():
        parameter.grad = None
    with remat.track() as tracker:
        torch.autograd.backward(loss(model(x)))
    return before + tracker.peak_bytes


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes the search estimated, in order."""
    seen: list[int] = []
    resized = _largest.resized

    def counted(sample: Any, dim: int, old: int, new: int) -> Any:
        seen.append(new)
        return resized(sample, dim, old, new)

    monkeypatch.setattr(_largest, "resized", counted)
    yield seen


def test_configurations_parse_and_bad_ones_are_named() -> None:
    assert split_extras("full+tiles+head") == ("full", {"tiles": 8, "head": 1})
    assert split_extras("save_matmuls+offload+tiles=3") == ("save_matmuls", {"offload": 1, "tiles": 3})
    for bad in ("full+tile", "full+tiles=0", "full+head+head", "full+head=2"):
        with pytest.raises(ValueError, match="does not know the configuration"):
            split_extras(bad)
    with pytest.raises(ValueError, match="add to 'full' or 'save_matmuls'"):
        remat.estimate(stack(), torch.randn(1, 64, WIDTH), loss=loss, configs=("none+tiles",))


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_tiles_are_estimated_as_a_real_step_runs_them() -> None:
    x = torch.randn(1, 2048, WIDTH)
    report = remat.estimate(stack(), x, loss=loss, configs=("full", "full+tiles", "full+tiles=16"),
                            where=Block)
    for config, tiles in (("full", 0), ("full+tiles", 8), ("full+tiles=16", 16)):
        model = remat.apply(stack(), Block)
        if tiles:
            assert tile_blocks([(str(i), block) for i, block in enumerate(model)], tiles).tiled
        measured = real_peak(model, x)
        assert abs(report[config].peak_bytes / measured - 1) < 0.02, (config, report[config].peak_bytes, measured)
    assert report["full+tiles"].peak_bytes < 0.8 * report["full"].peak_bytes
    assert report["full+tiles=16"].peak_bytes < report["full+tiles"].peak_bytes


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_offload_is_estimated_as_it_runs_on_an_accelerator(test_device: str) -> None:
    device = f"{test_device}:0"
    x = torch.randn(1, 1024, WIDTH).to(device)
    configs = ("full+tiles", "full+tiles+offload")
    report = remat.estimate(stack(depth=6).to(device), x, loss=loss, configs=configs, where=Block, device=device)
    for config in configs:
        model = remat.apply(stack(depth=6).to(device), Block, offload="offload" in config)
        tile_blocks([(str(i), block) for i, block in enumerate(model)], 8)
        before = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x])
        for parameter in model.parameters():
            parameter.grad = None
        with remat.track() as tracker:
            torch.autograd.backward(loss(model(x)))
        measured = before + tracker.peak(device)
        assert abs(report[config].peak_bytes / measured - 1) < 0.05, (config, report[config].peak_bytes, measured)
    assert report["full+tiles+offload"].peak_bytes < report["full+tiles"].peak_bytes - x.nbytes // 2
    on_cpu = remat.estimate(stack(depth=6), x.cpu(), loss=loss, configs=configs, where=Block)
    assert on_cpu["full+tiles"].peak_bytes == on_cpu["full+tiles+offload"].peak_bytes, "offload: a CPU pass-through"


@pytest.mark.slow  # measures real training steps for seconds: NOTE [ Slow tests ] in tests/conftest.py
def test_longest_sequence_from_a_few_estimates_where_the_peak_is_affine(probes: list[int]) -> None:
    memory = 8 * 2**20
    x = torch.randn(1, 256, WIDTH)
    report = remat.estimate(stack(), x, loss=loss, configs=("full+tiles",), where=Block, memory=memory,
                            seq_dim=1)
    longest = report["full+tiles"].largest_seq
    assert longest is not None and longest > 4 * 256
    assert len(probes) <= 4, f"a search, not a few estimates: {probes}"

    def peak(seq: int) -> int:
        model = remat.apply(stack(), Block)
        tile_blocks([(str(i), block) for i, block in enumerate(model)], 8)
        return real_peak(model, torch.randn(1, seq, WIDTH))

    assert peak(longest) <= memory < peak(int(longest * 1.01) + 1)


def test_the_search_falls_back_where_the_peak_is_not_affine(probes: list[int]) -> None:
    memory = 4 * 2**20
    x = torch.randn(1, 64, WIDTH)
    report = remat.estimate(stack(Quadratic, depth=2), x, loss=loss, configs=("none",), memory=memory, seq_dim=1)
    longest = report["none"].largest_seq
    assert longest is not None and len(probes) > 4  # the lines did not hold: the bisection found it
    model = stack(Quadratic, depth=2)
    with remat.enabled(False):
        assert real_peak(model, torch.randn(1, longest, WIDTH)) <= memory
        assert real_peak(model, torch.randn(1, longest + 1, WIDTH)) > memory


@pytest.fixture
def depths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int | None]]:
    """The depth of each step the estimate ran, in order (None: the whole model)."""
    seen: list[int | None] = []
    row = _predict._Steps.row

    def counted(self: Any, configured: Any, given: Any, depth: int | None = None) -> Any:
        seen.append(depth)
        return row(self, configured, given, depth)

    monkeypatch.setattr(_predict._Steps, "row", counted)
    yield seen


def _searched(model: nn.Module, x: torch.Tensor, configs: tuple[str, ...], memory: int,
              monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> dict[str, tuple[int | None, int | None]]:
    """Each configuration's largest batch and longest sequence, found by the whole model's search alone."""
    with monkeypatch.context() as patched:
        patched.setattr(_predict, "identical_layers", lambda model: None)
        report = remat.estimate(model, x, configs=configs, memory=memory, batch_dim=0, seq_dim=1, **kwargs)
    return {config: (report[config].largest_batch, report[config].largest_seq) for config in configs}


@pytest.mark.slow  # checks the answer against an exhaustive search: NOTE [ Slow tests ] in tests/conftest.py
def test_the_cut_models_give_the_searchs_answer_with_one_check_at_full_depth(
        depths: list[int | None], monkeypatch: pytest.MonkeyPatch) -> None:
    memory, x, configs = 24 * 2**20, torch.randn(1, 256, WIDTH, dtype=torch.float64), ("full", "full+tiles")
    model = stack(depth=12).double()
    report = remat.estimate(model, x, loss=loss, configs=configs, where=Block, memory=memory, batch_dim=0,
                            seq_dim=1)
    whole = [depth for depth in depths if depth is None]
    assert len(whole) == 3 * len(configs), f"one row and one check per search at full depth: {depths}"
    assert set(depths) == {None, *_largest.DEPTHS}
    for config in configs:
        assert report[config].largest_seq is not None and report[config].largest_seq > 4 * 256
    assert _searched(model, x, configs, memory, monkeypatch, loss=loss, where=Block) == {
        config: (report[config].largest_batch, report[config].largest_seq) for config in configs}

    def peak(seq: int) -> int:  # the tiled row against real steps, in float64
        tiled = remat.apply(stack(depth=12).double(), Block)
        tile_blocks([(str(i), block) for i, block in enumerate(tiled)], 8)
        return real_peak(tiled, torch.randn(1, seq, WIDTH, dtype=torch.float64))

    longest = report["full+tiles"].largest_seq
    assert peak(longest) <= memory < peak(int(longest * 1.01) + 1)


def test_the_two_searches_share_the_cut_models_steps_at_the_samples_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Searching the largest batch ], implementation note 5: the largest batch's search and the longest
    sequence's run the cut models at the sample's own size once, on the sample itself, as the whole model's row."""
    x = torch.randn(1, 256, WIDTH, dtype=torch.float64)
    steps: list[tuple[int | None, bool]] = []
    row = _predict._Steps.row

    def counted(self: Any, configured: Any, given: Any, depth: int | None = None) -> Any:
        steps.append((depth, given is x))
        return row(self, configured, given, depth)

    monkeypatch.setattr(_predict._Steps, "row", counted)
    report = remat.estimate(stack(depth=12).double(), x, loss=loss, configs=("full",), where=Block,
                            memory=24 * 2**20, batch_dim=0, seq_dim=1)
    assert report["full"].largest_batch is not None and report["full"].largest_seq is not None
    at_sample = [depth for depth, sample in steps if sample]
    assert sorted(at_sample, key=str) == sorted([None, *_largest.DEPTHS], key=str), steps


def test_the_whole_models_search_runs_where_the_cut_models_do_not_add_up(
        depths: list[int | None], monkeypatch: pytest.MonkeyPatch) -> None:
    memory, x = 6 * 2**20, torch.randn(1, 64, WIDTH, dtype=torch.float64)
    model = stack(Quadratic, depth=8).double()
    report = remat.estimate(model, x, loss=loss, configs=("none",), memory=memory, seq_dim=1)
    longest = report["none"].largest_seq
    assert set(_largest.DEPTHS) <= set(depths), "the cut models were tried"
    assert len([depth for depth in depths if depth is None]) > 4, f"the search ran at full depth: {depths}"
    with remat.enabled(False):
        assert real_peak(model, torch.randn(1, longest, WIDTH, dtype=torch.float64)) <= memory
        assert real_peak(model, torch.randn(1, longest + 1, WIDTH, dtype=torch.float64)) > memory


class Headed(nn.Module):
    """Identical blocks under a wide head: at a short sequence each block's gradients outweigh its activations, and
    the head's output is alive at backward's start, so without remat backward peaks at its start in a few layers and
    at its end in many."""

    def __init__(self, depth: int, vocabulary: int = 4096) -> None:
        super().__init__()
        self.layers = stack(depth=depth)
        self.head = nn.Linear(WIDTH, vocabulary)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def test_the_cut_models_add_up_where_backward_peaks_at_either_end(depths: list[int | None],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Searching the largest batch ], rule 6: the cut models follow backward in parts, each affine in the
    depth, where backward's whole peak moves from one end to the other between their depth and the model's."""
    memory, x = 8 * 2**20, torch.randn(1, 8, WIDTH, dtype=torch.float64)
    model = Headed(depth=12).double()
    report = remat.estimate(model, x, loss=loss, configs=("none",), memory=memory, batch_dim=0, seq_dim=1)
    found = (report["none"].largest_batch, report["none"].largest_seq)
    assert len([depth for depth in depths if depth is None]) == 3, f"one row and one check per search: {depths}"
    assert _searched(model, x, ("none",), memory, monkeypatch, loss=loss) == {"none": found}
    batch, longest = found
    assert batch is not None and longest is not None and longest > 8
    with remat.enabled(False):
        assert real_peak(model, torch.randn(1, longest, WIDTH, dtype=torch.float64)) <= memory
        assert real_peak(model, torch.randn(1, longest + 1, WIDTH, dtype=torch.float64)) > memory
        assert real_peak(model, torch.randn(batch, 8, WIDTH, dtype=torch.float64)) <= memory
        assert real_peak(model, torch.randn(batch + 1, 8, WIDTH, dtype=torch.float64)) > memory


@pytest.mark.slow  # checks the answer against an exhaustive search: NOTE [ Slow tests ] in tests/conftest.py
def test_a_llama_with_eager_attention_falls_back_and_agrees(depths: list[int | None],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from remat._estimate_cli import hf_case

    for attention, configs, memory in (("sdpa", ("full", "full+head+tiles"), 16 * 2**20),
                                       ("eager", ("none",), 64 * 2**20)):
        case = hf_case("llama", tiny=True, layers=6, seq=64, dtype=torch.float64)
        case.model.config._attn_implementation = attention  # eager attention keeps its seq x seq weights
        depths.clear()
        report = remat.estimate(case.model, case.sample, optimizer="adamw", configs=configs, memory=memory,
                                batch_dim=0, seq_dim=1)
        found = {config: (report[config].largest_batch, report[config].largest_seq) for config in configs}
        whole = len([depth for depth in depths if depth is None])
        assert _searched(case.model, case.sample, configs, memory, monkeypatch, optimizer="adamw") == found
        if attention == "sdpa":
            assert whole == 3 * len(configs), depths
        else:
            assert whole > 3 * len(configs), depths


def test_the_command_line_reports_errors_on_one_line(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.__main__ import main
    from remat._estimate_cli import HF_MISSING

    monkeypatch.setitem(sys.modules, "transformers", None)  # as where the `hf` extra is not installed
    assert main(["estimate", "--hf", "llama"], io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.strip() == HF_MISSING and "pip install 'remat[hf]'" in err and "pip install -e '.[hf]'" in err, err
    monkeypatch.undo()
    pytest.importorskip("transformers")
    assert main(["estimate", "--hf", "llama", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8",
                 "--configs", "full+wings"], io.StringIO()) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "does not know the configuration 'full+wings'" in err, err
    with pytest.raises(SystemExit) as exited:
        main(["estimate", "--largest-seq"], io.StringIO())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--largest-seq goes with --memory" in err, err


TINY = ("--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "8")


@pytest.mark.parametrize(("flags", "says"), [
    (("--hf", "llama", *TINY, "--seq", "0"), "argument --seq: expected at least 1, but got 0"),
    (("--hf", "llama", *TINY, "--batch", "two"), "argument --batch: expected a whole number, but got 'two'"),
    (("--hf", "llama", *TINY, "--world-size", "0"), "argument --world-size: expected at least 1"),
    (("--hf", "llama", *TINY, "--device", "gpu"), "argument --device: "),
    (("--layers", "2"), "--layers goes with --hf"),
    (("--hf", "llama", "--model", "gpt"), "--model and --hf each name a model"),
    (("--hf", "llama", *TINY, "--memory", "lots"), "estimate's `memory` is a device's memory in bytes"),
    (("--hf", "bert", *TINY, "--optimizer", "none", "--memory", "1GiB", "--largest-seq"),  # past its 512 positions
     "remat: estimate failed: RuntimeError: "),
])
def test_every_error_of_the_command_line_is_one_line(flags: tuple[str, ...], says: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from remat.__main__ import main

    try:
        status = main(["estimate", *flags], io.StringIO())
    except SystemExit as exited:  # a usage error, as argparse reports it
        status = exited.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status not in (0, None), err
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err


_WITHOUT_TRANSFORMERS = """
import sys


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "transformers":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
from remat.__main__ import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a process of its own: NOTE [ Slow tests ] in tests/conftest.py
def test_a_new_user_without_transformers_is_told_what_to_install() -> None:
    from remat._estimate_cli import HF_MISSING

    root = Path(__file__).resolve().parents[2]
    for flags in (["--hf", "llama"], ["--hf", "llama", "--dtype", "bfloat16", "--memory", "80GiB", "--largest-seq"]):
        done = subprocess.run([sys.executable, "-c", _WITHOUT_TRANSFORMERS, "estimate", *flags], cwd=root,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and done.stderr == HF_MISSING + "\n" and not done.stdout, done


def test_the_default_table_of_a_causal_lm_has_the_long_sequence_rows() -> None:
    pytest.importorskip("transformers")
    from remat._estimate_cli import default_configs, hf_case

    llama = hf_case("llama", tiny=True, seq=16).model
    assert default_configs(llama, "cpu", largest_seq=False) == (
        "none", "full", "save_matmuls", 0.3, "full+head", "full+head+tiles")
    assert default_configs(llama, "cuda", largest_seq=False)[-1] == "full+head+tiles+offload"
    assert default_configs(llama, "cpu", largest_seq=True) == (
        "none", "full", "save_matmuls", "full+head", "full+head+tiles")  # the budget's row re-plans at every size
    bert = hf_case("bert", tiny=True, seq=16).model  # a masked LM: no head to route, no long-sequence rows
    assert default_configs(bert, "cuda", largest_seq=False) == ("none", "full", "save_matmuls", 0.3)
    from remat.__main__ import main

    out = io.StringIO()
    assert main(["estimate", "--hf", "llama", *TINY, "--optimizer", "none"], out) == 0
    rows = [line.split()[0] for line in out.getvalue().splitlines() if line[:1].isalpha()]
    assert {"full+head", "full+head+tiles"} <= set(rows), out.getvalue()


@pytest.mark.slow  # starts a subprocess: NOTE [ Slow tests ] in tests/conftest.py
def test_the_command_line_compares_the_configurations_of_long_sequences() -> None:
    pytest.importorskip("transformers")
    from remat.__main__ import main

    out = io.StringIO()
    assert main(["estimate", "--hf", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64",
                 "--optimizer", "none", "--memory", "160MiB", "--largest-seq"], out) == 0
    text = out.getvalue()
    for config in ("none", "full", "save_matmuls", "full+head", "full+head+tiles"):
        assert f"\n{config}: largest batch that fits in 160.00 MiB" in text, text
    assert "offload" not in text  # a CPU pass-through: priced on an accelerator only
    longest = {line.split(":")[0]: int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if "sequence length" in line}
    assert longest["none"] < longest["full"] < longest["full+head"] <= longest["full+head+tiles"], longest


@pytest.mark.parametrize("seq, ran", [(4 * 2**15 + 1001, 3), (4 * 2**15, 2)], ids=["two sizes", "one size"])
def test_an_estimate_runs_a_few_parts_of_the_head_and_of_tiles_and_counts_what_all_of_them_hold(
        monkeypatch: pytest.MonkeyPatch, seq: int, ran: int) -> None:
    """NOTE [ Counted once ]: the rows are those of every chunk and tile, from three of each where the parts have
    two sizes, from two where they have one."""
    pytest.importorskip("transformers")
    import contextlib

    from remat._engine import stats
    from remat._engine.once import parts
    from remat._estimate_cli import hf_case
    from remat._sites import cross_entropy

    # more than three chunks and tiles (NOTE [ Counted once ]: the second is the first size with the sums), of two
    # sizes each or of one
    case = hf_case("llama", tiny=True, layers=2, seq=seq, dtype=torch.float64)
    spans = []

    def spied(items: Any, tensor: torch.Tensor, *, even: bool = False) -> Any:
        spans.append((len(items), even))
        return parts(items, tensor, even=even)

    monkeypatch.setattr(cross_entropy, "parts", spied)

    def rows() -> tuple[list[tuple[Any, ...]], int, int]:
        chunks, tiles = stats.head_chunks, stats.tiles
        report = remat.estimate(case.model, case.sample, optimizer="adamw", configs=("full+head", "full+head+tiles"))
        return ([(row.peak_bytes, row.phase_bytes, row.activation_bytes, row.holders) for row in report.rows],
                stats.head_chunks - chunks, stats.tiles - tiles)

    once, chunks, tiles = rows()
    assert len(spans) == 2 and {even for _, even in spans} == {ran == 2}, spans
    count = spans[0][0]
    with monkeypatch.context() as patched:
        patched.setattr(_predict, "counted_once", contextlib.nullcontext)
        every, all_chunks, all_tiles = rows()
    assert once == every
    assert (chunks, tiles) == (2 * ran, all_tiles // 8 * ran), (chunks, all_chunks, tiles, all_tiles)
    assert all_chunks == 2 * count


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=16000, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def _hooks(model: nn.Module) -> list[tuple[str, str, list[Any]]]:
    return [(name, table, list(getattr(module, table).values())) for name, module in model.named_modules()
            for table in ("_forward_pre_hooks", "_forward_hooks")] + \
        [(name, "own", list(vars(module).get(attr) for attr in ("forward", "_loss_function")))
         for name, module in model.named_modules()]


@pytest.mark.parametrize("applied", ["head and tiles", "budget"])
def test_an_estimate_of_a_model_remat_was_applied_to_is_the_fresh_models_and_leaves_it_as_it_was(
        applied: str) -> None:
    ids = torch.randint(0, 16000, (2, 128), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    configs = ("none", "full", "save_matmuls", "full+head", "full+head+tiles=2", 0.45)
    fresh = remat.estimate(_gpt2(), sample, optimizer="adamw", configs=configs)
    model = _gpt2()
    if applied == "budget":  # a budget only the chunked head fits: the plan routes it
        remat.apply(model, budget=0.45, sample=sample)
    else:
        remat.apply(model, head=True, tiles=4)
    assert remat._sites.head.routed_by(model) is not None
    plan, hooks = str(remat.plan(model)), _hooks(model)
    got = remat.estimate(model, sample, optimizer="adamw", configs=configs)
    for config in configs:  # the applied head (and tiles) in no row that does not ask for them
        assert got[config].peak_bytes == fresh[config].peak_bytes, config
    assert fresh["full+head"].peak_bytes < 0.8 * fresh["full"].peak_bytes  # a head left on would show
    assert str(remat.plan(model)) == plan
    after = _hooks(model)
    assert all(a[:2] == b[:2] and len(a[2]) == len(b[2]) and all(x is y for x, y in zip(a[2], b[2], strict=True))
               for a, b in zip(after, hooks, strict=True))
    assert model(**sample).logits is None  # the user's head still routed



class LearnedPositions(nn.Module):
    """GPT-2's embeddings: a table of learned positions (`wpe`) bounds the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(96, 32), nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = h + block(h)
        return h.square().mean()


def test_a_longest_sequence_beyond_a_table_of_learned_positions_is_marked() -> None:
    """A model with a table of 64 learned positions takes at most 64 tokens: the memory's longest sequence is
    reported, and the text says the model cannot take it. Before, the estimate answered a length the model cannot
    run (GPT-2 past `n_positions`), silently."""
    report = remat.estimate(LearnedPositions(), torch.randint(0, 96, (1, 32)), configs=("full",), memory="16MiB",
                            seq_dim=1)
    assert report.positions == ("wpe", 64) and report.to_dict()["positions"] == ["wpe", 64]
    longest = report["full"].largest_seq
    assert longest is not None and longest > 64
    assert (f"sample's batch size: {longest} (more than the 64 positions `wpe` holds: the model takes at most 64)"
            in str(report))
    transformers = pytest.importorskip("transformers")
    opt = transformers.OPTForCausalLM(transformers.OPTConfig(
        num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2, vocab_size=96,
        max_position_embeddings=48, word_embed_proj_dim=16))
    assert _largest.position_table(opt) == ("model.decoder.embed_positions", 48)  # its table has 2 rows more
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=96))
    assert _largest.position_table(llama) is None  # rotary: no table bounds the sequence
