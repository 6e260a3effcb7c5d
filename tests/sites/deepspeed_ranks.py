"""One rank of the DeepSpeed runs of tests/sites/test_deepspeed.py: started by `torch.distributed.run` (2 ranks,
gloo, CPU), it runs the cases named on the command line and saves each one's result for the pytest process.

A case trains a tiny Llama (hidden 64, 4 layers, fp32) for a few steps under DeepSpeed ZeRO-2 or ZeRO-3 (every
parameter partitioned: persistence threshold, reuse distance, live parameters and prefetch bucket all 0), directly
on the engine (`deepspeed.initialize`) or through the Hugging Face Trainer (the model built inside `zero.Init`
under ZeRO-3), with remat's budget applied before or after the engine, or not at all (the reference). What it
saves: the loss of every step, every parameter (full, fp32) after the last one, the budget's plan after each
step, each step's measured peak, what remat logged, or the rank's traceback.

    python -m torch.distributed.run --nproc-per-node 2 tests/sites/deepspeed_ranks.py OUT CASE [CASE ...]
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import remat  # noqa: E402
from remat._engine import stats  # noqa: E402

HIDDEN, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 128, 128, 4
LR = 1e-3


@dataclasses.dataclass(frozen=True)
class Case:
    """How one case trains.

    Attributes:
        path: "engine" (`deepspeed.initialize` and the engine's loop) or "trainer" (the Hugging Face Trainer).
        stage: ZeRO's stage, 2 or 3.
        remat: "none" (the reference) or "budget" (`remat.apply(model, budget=...)`, or `memory=`).
        when: where remat.apply is called: "before" `deepspeed.initialize` (for the Trainer: before `Trainer`),
            "after" it (on `engine.module`), "gathered" (before, inside `GatheredParameters`: ZeRO-3).
        lora: LoRA adapters (peft) on the attention's q and v projections; the rest frozen.
        seqs: the sequence length of each step's batch (a new one makes the budget plan again).
        budget: the budget given to remat.apply.
        replan: remat.apply's `replan`.
        bucket: ZeRO's `reduce_bucket_size` (elements); None: DeepSpeed's default.
        memory: remat.apply's `memory=` (with `optimizer="adamw"`) instead of `budget=`.
    """

    path: str = "engine"
    stage: int = 3
    remat: str = "budget"
    when: str = "before"
    lora: bool = False
    seqs: tuple[int, ...] = (SEQ, SEQ)
    budget: float | str = 0.5
    replan: bool = True
    bucket: int | None = 500_000
    memory: str | None = None


CASES: dict[str, Case] = {
    # remat.apply before deepspeed.initialize; the engine partitions the model, the second step is shorter
    "engine_zero3_before": Case(seqs=(SEQ, 96)),
    # the same with replan=False: the first plan is kept through the engine and the new shape
    "engine_zero3_kept": Case(seqs=(SEQ, 96), replan=False),
    # remat.apply on engine.module after deepspeed.initialize, LoRA adapters; a bucket larger than the activations
    "engine_zero3_lora_after": Case(when="after", lora=True, seqs=(SEQ, 96), bucket=5_000_000),
    # ZeRO-2 after deepspeed.initialize: its gradient bucket (20 MB) dwarfs the budget
    "engine_zero2_after": Case(stage=2, when="after", seqs=(SEQ, 96), bucket=5_000_000),
    # memory= after deepspeed.initialize: a plan verified by a real step would be reduced by the engine
    "engine_zero2_memory_after": Case(stage=2, when="after", seqs=(SEQ, 96), memory="12MiB"),
    # the Trainer: the model built inside zero.Init (ZeRO-3), LoRA; the Trainer adds `num_items_in_batch`
    "trainer_zero3_lora": Case(path="trainer", lora=True),
    # the Trainer, ZeRO-3, full fine-tuning, planned inside GatheredParameters (the parameters whole for a while)
    "trainer_zero3_gathered": Case(path="trainer", when="gathered"),
    # the Trainer, ZeRO-2, full fine-tuning; a bucket larger than the activations
    "trainer_zero2": Case(path="trainer", stage=2, bucket=5_000_000),
}


def reference(case: Case) -> Case:
    """The same training without remat (the bucket changes no number)."""
    return dataclasses.replace(case, remat="none", when="before", budget=0.5, replan=True, bucket=500_000,
                               memory=None)


def reference_name(name: str) -> str:
    """The name of the reference run `name` is compared with: one per training (path, stage, LoRA, shapes)."""
    case = reference(CASES[name])
    return f"reference-{case.path}-{case.stage}-{'lora' if case.lora else 'full'}-{'-'.join(map(str, case.seqs))}"


def case_of(name: str) -> Case:
    """A case by name: one of `CASES`, or a reference's name (`reference_name`)."""
    for known in CASES:
        if reference_name(known) == name:
            return reference(CASES[known])
    return CASES[name]


def ds_config(case: Case) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case.stage}
    if case.stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0, stage3_max_live_parameters=0,
                    stage3_prefetch_bucket_size=0)
    if case.bucket is not None:
        zero["reduce_bucket_size"] = case.bucket
        if case.stage == 2:
            zero["allgather_bucket_size"] = case.bucket
    auto = case.path == "trainer"
    return {
        "train_micro_batch_size_per_gpu": "auto" if auto else BATCH,
        "gradient_accumulation_steps": "auto" if auto else 1,
        "train_batch_size": "auto" if auto else BATCH * 2,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def save_pretrained(directory: Path) -> None:
    """The tiny Llama's weights, the same on every rank (seeded), saved for `from_pretrained`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)


def batch(rank: int, step: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def with_lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' initial weights: the same on every rank and in every run
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))


def full_params(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole, in fp32 (gathered under ZeRO-3)."""
    import deepspeed

    out = {}
    for name, p in model.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.detach().clone().float()
        else:
            out[name] = p.detach().clone().float()
    return out


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def plan_of(model: Any) -> dict[str, Any] | None:
    found = remat.plan(model).budget
    if found is None:
        return None
    return {"choice": [found.choices[c] for c in found.choice], "measured": found.measured,
            "budget": found.budget, "peak": found.peak_bytes}


def apply_budget(model: Any, case: Case, sample: dict[str, torch.Tensor]) -> None:
    if case.memory is not None:
        remat.apply(model, memory=case.memory, sample=sample, optimizer="adamw", replan=case.replan)
    elif case.when == "gathered":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            remat.apply(model, budget=case.budget, sample=sample, replan=case.replan)
    else:
        remat.apply(model, budget=case.budget, sample=sample, replan=case.replan)


def build(case: Case, directory: Path) -> Any:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    return with_lora(model) if case.lora else model


def run_engine(case: Case, rank: int, directory: Path) -> dict[str, Any]:
    """Train on the engine; a reference (no remat) also tracks the rank's live bytes from before the model is
    built, and estimates its last step (`remat.estimate` on the engine's model, AdamW, no remat)."""
    if case.remat != "none":
        return _run_engine(case, rank, directory, None)
    with remat.track() as tracker:
        result = _run_engine(case, rank, directory, tracker)
    return result


def _run_engine(case: Case, rank: int, directory: Path, tracker: Any) -> dict[str, Any]:
    import deepspeed

    model = build(case, directory)
    model.train()
    first = batch(rank, 0, case.seqs[0])
    if case.remat == "budget" and case.when in ("before", "gathered"):
        apply_budget(model, case, first)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(case))
    if case.remat == "budget" and case.when == "after":
        apply_budget(engine.module, case, first)
    losses, plans, recomputes = [], [], []
    result: dict[str, Any] = {}
    for step, seq in enumerate(case.seqs):
        before = stats.recomputes
        if tracker is not None:
            tracker._restart_peak()  # the last step's peak, the state it starts with included
        inputs = batch(rank, step, seq)
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        recomputes.append(stats.recomputes - before)
        losses.append(loss.item())
        plans.append(plan_of(engine.module))
        del loss
    if tracker is not None:
        row = remat.estimate(engine.module, inputs, optimizer="adamw", configs=("none",))["none"]
        result.update(tracked=tracker.peak_bytes, estimated=row.peak_bytes, engine_bytes=row.engine_bytes)
    return {**result, "losses": losses, "plans": plans, "recomputes": recomputes,
            "params": full_params(engine.module)}


def trainer_state() -> None:
    """Accelerate's state for the Trainer under DeepSpeed on CPU ranks: on a machine without an accelerator,
    `TrainingArguments(deepspeed=...)` leaves the backend unset and trains one process alone, so the state is made
    here, for DeepSpeed over gloo, and the arguments told to use it (`use_configured_state`)."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer of an earlier case made one
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


def run_trainer(case: Case, rank: int, directory: Path) -> dict[str, Any]:
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    trainer_state()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            accelerator_config={"use_configured_state": True},
            output_dir=out, per_device_train_batch_size=BATCH, max_steps=len(case.seqs), learning_rate=LR,
            deepspeed=ds_config(case), report_to=[], save_strategy="no", logging_steps=1, seed=0, data_seed=0,
            disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            dataloader_drop_last=True,
        )
        model = LlamaForCausalLM.from_pretrained(directory)  # inside zero.Init under ZeRO-3 (the Trainer's config)
        if case.lora:
            model = with_lora(model)
        model.train()
        if case.remat == "budget":
            apply_budget(model, case, batch(rank, 0, case.seqs[0]))
        rows = [batch(0, step, case.seqs[0]) for step in range(2 * len(case.seqs))]
        data = [{k: v[i] for k, v in row.items()} for row in rows for i in range(BATCH)]
        plans: list[Any] = []
        recomputes: list[int] = []

        class Plans(TrainerCallback):  # type: ignore[misc]
            def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
                recomputes.append(stats.recomputes)

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                recomputes[-1] = stats.recomputes - recomputes[-1]
                plans.append(plan_of(model))

        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Plans()])
        trainer.train()
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        return {"losses": losses, "plans": plans, "recomputes": recomputes,
                "params": full_params(trainer.model_wrapped.module)}


def main(argv: list[str]) -> int:
    import deepspeed

    out = Path(argv[0])
    names = argv[1:]
    warnings.simplefilter("default")
    warnings.filterwarnings("error", message="remat: ", category=UserWarning)  # a budget's warning fails the case
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    lines = Lines()
    logging.getLogger("remat").addHandler(lines)
    logging.getLogger("remat").setLevel(logging.INFO)
    weights = out / "weights"
    if rank == 0 and not (weights / "config.json").exists():
        save_pretrained(weights)
    torch.distributed.barrier()
    for name in names:
        case = case_of(name)
        lines.lines.clear()
        try:
            runner = run_trainer if case.path == "trainer" else run_engine
            result: Any = runner(case, rank, weights)
            result["log"] = list(lines.lines)
        except Exception:
            result = f"rank {rank}, case {name}:\n{traceback.format_exc()}\nremat logged: {lines.lines}"
        finally:
            # a Trainer's ZeRO-3 config would make every later `from_pretrained` here build inside zero.Init
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        torch.save(result, out / f"{name}.rank{rank}.pt")
        torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
