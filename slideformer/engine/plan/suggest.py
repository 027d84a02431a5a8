"""Known-good first settings for a model on a machine: method, adapter rank, learning rate,
sequence length and batch, each with the reason it was chosen.

The starting points are those of LLaMA-Factory's examples (``examples/train_full/
llama3_full_sft.yaml`` and ``examples/train_lora/llama3_lora_sft.yaml``: learning rate 1e-5
for full fine-tuning and 1e-4 for LoRA, LoRA rank 8 on every linear layer, 2,048-token
sequences, 16K tokens per step in the LoRA example, cosine decay); what this engine adds is the
machine: the method is the first of full / LoRA / QLoRA the planner says fits, and the
micro-batch is the largest that fits up to those 16K tokens per step (the engine streams the
weights once per step, so fewer, larger micro-batches are faster: benchmarks/RESULTS.md).

A suggestion only fills the form: every value stays visible and editable.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from slideformer.engine.config import RunConfig, override
from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.plan.hardware import HardwareProfile
from slideformer.engine.plan.planner import fit_verdict, plan_run, resolve_machine

SEQ_LEN = 2048
TOKENS_PER_STEP = 16_384
LEARNING_RATES = {"full": 1e-5, "lora": 1e-4, "qlora": 1e-4}
RANK = 8
METHOD_NAMES = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}


@dataclass(frozen=True)
class Suggestion:
    values: dict
    """Dotted run-config keys -> values (``{"train.method": "lora", ...}``)."""
    reasons: tuple[str, ...]
    """One line per choice, for people."""
    verdict: str
    """The planner's verdict of the suggested settings."""

    def tables(self) -> dict:
        """The values as ``{section: {key: value}}`` (a preset's and a TOML file's shape)."""
        out: dict = {}
        for key, value in self.values.items():
            section, _, name = key.partition(".")
            out.setdefault(section, {})[name] = value
        return out


def suggest(cfg: RunConfig, spec: ModelSpec,
            hardware: HardwareProfile | str = "auto") -> Suggestion:
    """Settings for ``spec`` on ``hardware`` (this machine by default), starting from ``cfg``
    (its budgets and device are kept)."""
    seq = min(SEQ_LEN, spec.max_position_embeddings)
    base = override(cfg, {"data.max_seq_len": seq, "train.micro_batch": 1, "train.grad_accum": 1,
                          "lora.rank": RANK, "lora.alpha": 2.0 * RANK})
    machine = resolve_machine(base, hardware)
    reasons = [f"{seq:,}-token sequences" + (" (the model's context)" if seq < SEQ_LEN else
                                              " (LLaMA-Factory's examples)")]
    verdicts = {}
    for method in ("full", "lora", "qlora"):
        verdicts[method] = fit_verdict(override(base, {"train.method": method}), spec, machine)
        if verdicts[method][0] != "does not fit":
            break
    method = next((m for m, (v, _) in verdicts.items() if v != "does not fit"), "qlora")
    skipped = [f"{METHOD_NAMES[m]} does not fit ({why})" for m, (v, why) in verdicts.items()
               if v == "does not fit" and m != method]
    on = machine.hardware.name
    reasons.append(f"{METHOD_NAMES[method]}: the first method that fits {on}"
                   + (f"; {'; '.join(skipped)}" if skipped else "")
                   if verdicts[method][0] != "does not fit" else
                   f"QLoRA, the smallest method, though it does not fit either "
                   f"({verdicts['qlora'][1]}): see the Plan page's fixes")
    lr = LEARNING_RATES[method]
    example = "full fine-tuning" if method == "full" else "LoRA"
    reasons.append(f"learning rate {lr:g} (LLaMA-Factory's {example} example)")
    values = {"train.method": method, "optim.lr": lr, "optim.schedule": "cosine",
              "data.max_seq_len": seq}
    if method != "full":
        values.update({"lora.rank": RANK, "lora.alpha": 2.0 * RANK})
        reasons.append(f"LoRA rank {RANK}, alpha {2 * RANK} on every linear layer")
    plan = plan_run(override(base, values), spec, machine.device, machine.hardware)
    per_step = max(1, TOKENS_PER_STEP // seq)
    micro = max(1, min(plan.max_micro_batch, per_step))
    accum = math.ceil(per_step / micro)
    values.update({"train.micro_batch": micro, "train.grad_accum": accum})
    reasons.append(f"{micro} sequences per micro-batch x {accum} micro-batch"
                   f"{'es' if accum > 1 else ''}: "
                   f"{micro * accum * seq:,} tokens per step, as LLaMA-Factory's LoRA example"
                   + (f" (a micro-batch of {micro} is the largest that fits)"
                      if micro < per_step else ""))
    final = plan_run(override(base, values), spec, machine.device, machine.hardware)
    return Suggestion(values, tuple(reasons), final.verdict)

