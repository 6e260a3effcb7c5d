"""transformers' packed-sequence question answers "not packed" for fake ids, and its padding question "no padding"
for a fake mask where the sample has none, only inside an estimate, in the thread that runs it, and each is put
back however estimates in several threads end (NOTE [ transformers and fake tensors ] in
remat/_measure/hf_fake.py)."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest
import torch

from remat._measure.fake import fake_mode
from remat._measure.hf_fake import real_masks


def _packed(position_ids: torch.Tensor) -> Any:
    return "packed?"


def _causal_skip(padding_mask: torch.Tensor | None, q_length: int, kv_length: int, q_offset: int, kv_offset: int,
                 local_attention_size: int | None = None) -> Any:
    return "asked of", padding_mask


def _bidirectional_skip(padding_mask: torch.Tensor | None, kv_length: int,
                        local_attention_size: int | None = None) -> Any:
    return "asked of", padding_mask


@pytest.fixture
def masking(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for transformers.masking_utils, so that the test needs no transformers."""
    module = types.ModuleType("transformers.masking_utils")
    module.find_packed_sequence_indices = _packed  # type: ignore[attr-defined]
    module._ignore_causal_mask_sdpa = _causal_skip  # type: ignore[attr-defined]
    module._ignore_bidirectional_mask_sdpa = _bidirectional_skip  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", module)
    return module


def test_fake_ids_are_unpacked_only_inside(masking: Any) -> None:
    ids = torch.arange(8).unsqueeze(0)
    with real_masks(ids):
        assert masking.find_packed_sequence_indices(ids) == "packed?"  # a real tensor still asks the real question
        with fake_mode() as mode:
            assert masking.find_packed_sequence_indices(mode.from_tensor(ids)) is None
    assert masking.find_packed_sequence_indices is _packed


def test_a_sample_with_its_own_position_ids_keeps_the_question(masking: Any) -> None:
    with real_masks({"position_ids": torch.zeros(1, 8)}):
        assert masking.find_packed_sequence_indices is _packed


def test_estimates_ending_in_any_order_across_threads_put_it_back(masking: Any) -> None:
    entered, leave_first = threading.Barrier(2), threading.Event()
    seen: dict[str, Any] = {}

    def first() -> None:  # enters first, leaves first: the second thread is still inside
        with real_masks(None):
            entered.wait()
            leave_first.wait()
        seen["after first"] = masking.find_packed_sequence_indices

    def second() -> None:
        entered.wait()
        with real_masks(None):
            leave_first.set()
            threads[0].join()
            seen["second still inside"] = masking.find_packed_sequence_indices

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen["after first"] is not _packed and seen["second still inside"] is not _packed
    assert masking.find_packed_sequence_indices is _packed  # the last one out put it back


def test_another_thread_is_not_answered_for(masking: Any) -> None:
    inside, done = threading.Event(), threading.Event()
    answers: list[Any] = []

    def estimate() -> None:
        with real_masks(None):
            inside.set()
            done.wait()

    thread = threading.Thread(target=estimate)
    thread.start()
    inside.wait()
    try:
        with fake_mode() as mode:  # this thread runs no estimate: its fake ids get the real question
            answers.append(masking.find_packed_sequence_indices(mode.from_tensor(torch.arange(4))))
    finally:
        done.set()
        thread.join()
    assert answers == ["packed?"]


@pytest.mark.parametrize("sample", ["unmasked", "ones"])
def test_a_fake_padding_mask_is_asked_of_as_none_where_the_sample_has_no_padding(masking: Any, sample: str) -> None:
    mask = torch.ones(1, 8, dtype=torch.long)
    ids = torch.arange(8).unsqueeze(0)
    with real_masks(ids if sample == "unmasked" else {"input_ids": ids, "attention_mask": mask}):
        real = masking._ignore_causal_mask_sdpa(mask, 8, 8, 0, 0)
        with fake_mode() as mode:
            fake = masking._ignore_causal_mask_sdpa(mode.from_tensor(mask), 8, 8, 0, 0, local_attention_size=4)
            both = masking._ignore_bidirectional_mask_sdpa(mode.from_tensor(mask), 8)
    assert real == ("asked of", mask) and fake == ("asked of", None) and both == ("asked of", None)
    assert masking._ignore_causal_mask_sdpa is _causal_skip
    assert masking._ignore_bidirectional_mask_sdpa is _bidirectional_skip


def _padded() -> dict[str, torch.Tensor]:
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": mask}


@pytest.mark.parametrize("sample", [
    _padded(),
    (torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)),  # which one is the mask?
    {"input_ids": torch.zeros(1, 8), "attention_mask": torch.ones(1, 8, device="meta")},
], ids=["padded", "positional", "meta"])
def test_a_sample_that_pads_or_cannot_be_read_keeps_the_padding_question(masking: Any, sample: Any) -> None:
    with real_masks(sample):
        assert masking._ignore_causal_mask_sdpa is _causal_skip
        assert masking._ignore_bidirectional_mask_sdpa is _bidirectional_skip


def test_the_padding_question_asked_with_keywords_is_answered_alike(masking: Any) -> None:
    mask = torch.ones(1, 8, dtype=torch.long)
    with real_masks({"attention_mask": mask}), fake_mode() as mode:
        fake = mode.from_tensor(mask)
        answer = masking._ignore_causal_mask_sdpa(padding_mask=fake, q_length=8, kv_length=8, q_offset=0,
                                                  kv_offset=0)
    assert answer == ("asked of", None)
