"""Fine-tune a Hugging Face model with PyTorch FSDP2, on one host or several (torchrun).

Written by ``slideformer export-distributed``: ``settings.json`` beside this file holds the run's
settings (model, AdamW hyper-parameters, the learning rate of every step, clipping, micro-batch
and accumulation) and ``data/`` the training rows (token ids, shifted labels, document ids) with
the order of every step, both taken from the SlideFormer run config, so this script trains what
``slideformer train`` would: the same rows in the same steps, the same optimizer. It needs torch,
transformers and numpy, nothing of SlideFormer.

One host, N GPUs (N = 1, 2, 4, 8; each GPU takes 1/N of every step's micro-batches):

    torchrun --standalone --nproc-per-node=N train_fsdp.py

Several hosts (M hosts of N GPUs; run this on every host, HOST0 is the first host's address,
reachable from all on PORT; JOB is any id shared by the hosts of one run):

    torchrun --nnodes=M --nproc-per-node=N --node-rank=R \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST0:PORT --rdzv-id=JOB train_fsdp.py

``torchrun.sh`` beside this file runs either (NNODES, NPROC, NODE_RANK, RDZV_ENDPOINT). The
number of processes must divide the step's micro-batches (``grad_accum`` in settings.json).
Options: ``--model DIR`` (the model folder on this machine), ``--run-dir DIR``, ``--cpu-offload
auto|on|off`` (FSDP2's CPUOffloadPolicy: parameters, gradients and AdamW state in host memory;
auto turns it on when a GPU's share of them exceeds half its memory).

The run folder is what the SlideFormer app opens: ``events.jsonl`` (its event format),
``config.toml`` and ``final/`` (a Hugging Face folder). CUDA: bf16 compute with fp32 master
weights and fp32 gradient reduction (MixedPrecisionPolicy), NCCL; CPU: fp32, gloo.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

HERE = Path(__file__).resolve().parent
IGNORE = -100
COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json", "chat_template.jinja", "tokenizer.model")
"""Files of the model folder that final/ keeps as they are (config.json names the dtype that
the weights are saved in: the model's own)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", default=str(HERE / "settings.json"))
    p.add_argument("--model", help="model folder (default: settings.json's)")
    p.add_argument("--run-dir", help="run folder (default: settings.json's)")
    p.add_argument("--cpu-offload", choices=("auto", "on", "off"), default="auto")
    return p.parse_args()


class Events:
    """Appends SlideFormer events (one JSON object a line) to the run's events.jsonl (rank 0)."""

    def __init__(self, path: Path | None):
        self.f = None if path is None else open(path, "a", encoding="utf-8")

    def emit(self, kind: str, **fields) -> None:
        if self.f is not None:
            self.f.write(json.dumps({"kind": kind, **fields, "time": time.time()}) + "\n")
            self.f.flush()

    def state(self, state: str, message: str = "", step: int = 0) -> None:
        self.emit("RunState", state=state, message=message, step=step)

    def log(self, level: str, message: str) -> None:
        self.emit("Log", level=level, message=message)


def peak_rss() -> int:
    """Peak resident memory of this process in bytes (Linux VmHWM; 0 elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Rows:
    """The exported training rows and the rows of every step: order[step, micro, row]."""

    def __init__(self, folder: Path):
        self.ids = np.load(folder / "input_ids.npy", mmap_mode="r")     # (R, T)
        self.labels = np.load(folder / "labels.npy", mmap_mode="r")     # (R, T), shifted
        self.docs = np.load(folder / "doc_ids.npy", mmap_mode="r")      # (R, T)
        self.order = np.load(folder / "order.npy")                      # (steps, A, B)

    def micro_batch(self, step: int, micro: int, device) -> tuple:
        """(input_ids, labels, position_ids, attention mask or None) of one micro-batch."""
        rows = self.order[step, micro]
        ids = torch.from_numpy(np.asarray(self.ids[rows], dtype=np.int64)).to(device)
        labels = torch.from_numpy(np.asarray(self.labels[rows], dtype=np.int64)).to(device)
        doc = torch.from_numpy(np.asarray(self.docs[rows], dtype=np.int64)).to(device)
        B, T = ids.shape
        pos = torch.arange(T, device=device).expand(B, T)
        start = torch.ones_like(doc, dtype=torch.bool)
        start[:, 1:] = doc[:, 1:] != doc[:, :-1]
        if not start[:, 1:].any():  # one document a row: plain causal attention
            return ids, labels, pos, None
        first = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        mask = (doc[:, :, None] == doc[:, None, :]) & causal   # attention stays in a document
        return ids, labels, pos - first, mask[:, None]


def setup_dist() -> tuple[int, int, torch.device]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def want_offload(choice: str, n_params: int, world: int, device: torch.device) -> bool:
    """AdamW with fp32 master, gradient and two moments: 16 bytes per parameter, 1/world each."""
    if choice != "auto":
        return choice == "on"
    if device.type != "cuda":
        return False
    return 16 * n_params / world > 0.5 * torch.cuda.get_device_properties(device).total_memory


def build_model(model_dir: str, device: torch.device, world: int, offload: str, events: Events):
    from transformers import AutoModelForCausalLM

    cuda = device.type == "cuda"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    if cuda:  # recompute each layer in the backward: activations of one layer at a time
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device.type, (world,))
    kw = {"mesh": mesh}
    if cuda:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if want_offload(offload, n_params, world, device):
        kw["offload_policy"] = CPUOffloadPolicy()
        events.log("info", "FSDP2 CPU offload: parameters, gradients and AdamW state in host memory")
    elif cuda:
        model.to(device)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model, n_params


def make_optimizer(model, s: dict) -> torch.optim.AdamW:
    """AdamW with decoupled weight decay on matrices only (norms and biases of any shape get
    none: the engine's rule, slideformer.engine.models.spec.decayed)."""
    named = list(model.named_parameters())
    decay = [p.dim() > 1 and not (n.endswith("norm.weight") or n.endswith("bias"))
             for n, p in named]
    groups = [{"params": [p for (_, p), d in zip(named, decay) if d],
               "weight_decay": s["weight_decay"]},
              {"params": [p for (_, p), d in zip(named, decay) if not d], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s["lrs"][0], betas=(s["beta1"], s["beta2"]), eps=s["eps"])


def train_step(model, opt, rows: Rows, step: int, s: dict, rank: int, world: int,
               device) -> tuple[float, float, int]:
    """One optimizer step over the step's micro-batches r, r+N, ... of this rank.

    Each micro-batch's summed token loss is divided by the step's trained tokens over all
    ranks and multiplied by the world size, because FSDP averages the ranks' gradients: their
    mean is then the gradient of the mean loss over the whole step (for a power-of-two world
    size the factor is exact in floating point).
    """
    micros = range(rank, rows.order.shape[1], world)
    tokens = int(sum((rows.labels[rows.order[step, m]] != IGNORE).sum()
                     for m in range(rows.order.shape[1])))
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m in micros:
        ids, labels, pos, mask = rows.micro_batch(step, m, device)
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
        lmb = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                labels.reshape(-1), ignore_index=IGNORE,
                                                reduction="sum")
        (lmb * (world / max(tokens, 1))).backward()
        loss_sum += lmb.detach().double()
    dist.all_reduce(loss_sum)
    loss = float(loss_sum) / max(tokens, 1)
    if s["max_grad_norm"] > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["max_grad_norm"])
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(loss) and math.isfinite(norm):
        for g in opt.param_groups:
            g["lr"] = s["lrs"][step]
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, norm, tokens


def export_final(model, model_dir: str, out: Path, s: dict, rank: int) -> None:
    """The trained weights as a Hugging Face folder (safetensors shards, config, tokenizer)."""
    from safetensors.torch import save_file

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if rank != 0:
        return
    dtype = {"float32": torch.float32, "float16": torch.float16,
             "bfloat16": torch.bfloat16}[s["save_dtype"]]
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight", None)  # the same tensor as the embedding
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards, size = [{}], 0
    for name, t in full.items():
        nbytes = t.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > s["shard_bytes"]:
            shards.append({})
            size = 0
        shards[-1][name] = t.to(dtype).contiguous()
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1 else
                 f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    if len(shards) > 1:
        total = sum(t.numel() * dtype.itemsize for t in full.values())
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for name in COPIED_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def main() -> None:
    args = parse_args()
    settings_path = Path(args.settings)
    s = json.loads(settings_path.read_text(encoding="utf-8"))
    model_dir = args.model or s["model"]
    run_dir = Path(args.run_dir or s["run_dir"])
    rank, world, device = setup_dist()
    rows = Rows(settings_path.parent / "data")
    steps, accum = rows.order.shape[:2]
    if accum % world:
        raise SystemExit(f"error: {world} processes cannot share the {accum} micro-batches of a "
                         f"step; fix: start a number of processes that divides {accum}")
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(settings_path.parent / "config.toml", run_dir / "config.toml")
    events = Events(run_dir / "events.jsonl" if rank == 0 else None)
    events.state("setup", "loading model and data")
    torch.manual_seed(s["seed"])
    model, n_params = build_model(model_dir, device, world, args.cpu_offload, events)
    opt = make_optimizer(model, s)
    events.log("info", f"FSDP2 over {world} processes ({device.type}): {n_params:,} parameters, "
                       f"{steps} steps of {accum} micro-batches")
    events.state("running")
    for step in range(steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        loss, norm, tokens = train_step(model, opt, rows, step, s, rank, world, device)
        dt = time.perf_counter() - t0
        seen = rows.order.shape[1] * rows.order.shape[2] * rows.ids.shape[1]
        finite = math.isfinite(loss) and math.isfinite(norm)
        events.emit("StepMetrics", step=step + 1, total_steps=steps,
                    loss=loss if finite else None, lr=s["lrs"][step],
                    grad_norm=norm if math.isfinite(norm) else None, tokens=tokens,
                    tokens_per_s=seen / dt, step_time=dt,
                    peak_vram=(torch.cuda.max_memory_reserved(device)
                               if device.type == "cuda" else None),
                    peak_ram=peak_rss(), skipped=not finite)
    events.state("saving", "exporting the final model", steps)
    export_final(model, model_dir, run_dir / "final", s, rank)
    events.state("finished", f"model saved to {run_dir / 'final'}", steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
