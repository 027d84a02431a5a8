"""LoRA / QLoRA on the sliding engine against Hugging Face + PEFT (+ bitsandbytes), one table
per invocation, every contender in a process of its own (fresh CUDA context, clean peaks).

    python3 benchmarks/lora_bench.py --table 8b     # Llama-3.1-8B shape: ours lora, qlora vs
                                                    # HF+PEFT lora, HF+PEFT+bnb qlora and
                                                    # Unsloth lora, qlora; 16K, 64K
    python3 benchmarks/lora_bench.py --table 70b    # Llama-3.1-70B shape, ours qlora at 64K
    python3 benchmarks/lora_bench.py --table 123b   # Mistral-Large-2 shape, ours qlora
    python3 benchmarks/lora_bench.py --table 30b-a3b  # Qwen3-30B-A3B (MoE), ours lora, qlora
    python3 benchmarks/lora_bench.py --table 120b-oss # GPT-OSS-120B (MoE, sinks), ours qlora
    python3 benchmarks/lora_bench.py --table 35b-a3b-q35  # Qwen3.5-35B-A3B (hybrid MoE), qlora
    python3 benchmarks/lora_bench.py --table 31b-gemma4   # Gemma-4 31B (heads of 256 / 512), qlora
    add --tiny for a CPU dry run of the same table on a tiny shape

Weights are random (N(0, 0.02)); ours quantises them layer by layer on the GPU into the host
state (the loading path from safetensors is tested in tests/). VRAM is capped in-process at
--vram-cap GiB (torch.cuda.set_per_process_memory_fraction) for every contender, after set-up.
Tokens/step = micro_batch x seq x grad_accum; HF and Unsloth train micro-batches one after
another with gradient checkpointing (Unsloth's own), ours layer-wise. Reported: tokens/s (median
of the timed steps), peak VRAM allocated / reserved, peak RSS (VmHWM), the GPU busy share of our
step (compute spans of the timeline over the step time) and the planner's prediction for our runs.
Unsloth runs on a CUDA GPU only: elsewhere (--tiny on a CPU) its records say it was skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from sliding_step import SHAPES, as_pairs, random_batches, shape_config  # noqa: E402

TABLES = {  # shape, contenders, tokens per step (micro_batch x accum at seq 1024)
    "8b": ("llama-3.1-8b", ("ours-lora", "ours-qlora", "hf-lora", "hf-qlora", "unsloth-lora",
                            "unsloth-qlora"), ((4, 4), (4, 16))),
    "70b": ("llama-3.1-70b", ("ours-qlora",), ((4, 4), (8, 8))),
    "123b": ("mistral-large-2", ("ours-qlora",), ((4, 4),)),
    # HF+PEFT holds the 61 GB bf16 base in VRAM: no contender of it under a 24 GiB cap
    "30b-a3b": ("qwen3-30b-a3b", ("ours-lora", "ours-qlora"), ((4, 4),)),
    # GPT-OSS keeps its experts as plain tensors, which bitsandbytes does not quantise: HF+PEFT
    # holds a 120B (20B) base of 233 (42) GB in bf16, beyond the cap, so no contender of it
    "120b-oss": ("gpt-oss-120b", ("ours-qlora",), ((4, 4),)),
    "20b-oss": ("gpt-oss-20b", ("ours-lora", "ours-qlora"), ((4, 4),)),
    "35b-a3b-q35": ("qwen3.5-35b-a3b", ("ours-qlora",), ((4, 4),)),
    # Gemma 4's full layers have heads of 512, which FlexAttention holds on the GPU. HF+PEFT+bnb
    # is built in bf16 on the GPU (62 GB: an 80 GB card holds it before the cap) and quantised
    # in place (hf_quantised_in_place), not written as a 62 GB folder first; under 24 GiB it ran
    # out of memory at every micro-batch (RESULTS.md, 2026-12-07 ninth session)
    "31b-gemma4": ("gemma-4-31b", ("ours-qlora", "hf-qlora"), ((4, 4), (1, 16))),
}
GiB = 1 << 30
MARK = "@@LORA "
SETUP: dict = {}  # the HF contender's set-up figures, kept for the record of a run out of memory
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # LoRA's
# Unsloth offline: no statistics download (a README fetched from the Hub at each load), no Hub or
# GitHub look-ups (model-name mapper), its compiled modules in a temporary folder, not the cwd
UNSLOTH_ENV = {"UNSLOTH_DISABLE_STATISTICS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1",
               "UNSLOTH_COMPILE_LOCATION": os.path.join(tempfile.gettempdir(), "unsloth_compiled")}
# HF + bnb saves and reloads the model to quantise it as users load one: in RAM where possible
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.statvfs("/dev/shm").f_bavail * \
    os.statvfs("/dev/shm").f_frsize > 40 * (1 << 30) else None


def peak_rss() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GiB
    return 0.0


def cap(vram_gib: float) -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, vram_gib * GiB / total))
        torch.cuda.reset_peak_memory_stats()


def vram() -> dict:
    if not torch.cuda.is_available():
        return {"peak_vram_alloc_gib": None, "peak_vram_reserved_gib": None}
    return {"peak_vram_alloc_gib": round(torch.cuda.max_memory_allocated() / GiB, 2),
            "peak_vram_reserved_gib": round(torch.cuda.max_memory_reserved() / GiB, 2)}


# ---- ours --------------------------------------------------------------------------------------
def random_frozen_state(spec, backend, lora, nf4: bool, device: str, dtype: torch.dtype,
                        tier=None):
    """Frozen base with random weights, quantised layer by layer on ``device`` (qlora); the
    layers ``tier`` (an NVMe tier) holds are written to their files, as loading does."""
    from slideformer.engine.runtime.lora import init_adapters, is_adapter
    from slideformer.engine.train.state import build_frozen_state
    host = build_frozen_state(spec, backend, dtype, torch.float32, lora, nf4=nf4, tier=tier)
    g = torch.Generator(device).manual_seed(0)
    for name, item in host.items():
        if is_adapter(name):
            continue
        w = torch.randn(item.numel, generator=g, device=device) * 0.02
        with item.stored(write=True) as dst:
            if item.quant is None:
                dst.copy_(w)
            else:
                out = torch.empty(item.quant.nbytes, dtype=torch.uint8, device=device)
                dst.copy_(item.quant.quantize(w, out))
        del w
    for item in host.values():
        if getattr(item, "disk", None) is not None:
            item.disk.flush()
    init_adapters({k: v for k, v in host.items() if is_adapter(k)}, seed=0)
    return host


def open_tier(plan, spec, folder: str, backend):
    """The NVMe tier of the layers whose frozen base the plan put on disk, opened as the trainer
    opens it (train.trainer.Trainer._open_tier); None: none."""
    if not plan.disk_layers:
        return None
    from slideformer.engine.runtime.nvme import NvmeTier
    from slideformer.engine.runtime.shapes import disk_layers
    return NvmeTier(folder, [f"layer{i}" for i in disk_layers(spec.num_layers, plan.disk_layers)],
                    size_limit=plan.budgets.disk, pin=backend.pin_mapping)


def planned_disk_read(plan, spec, slots: int, dtype, method: str) -> float:
    """GB a step reads from the NVMe tier by the plan (plan.frozen.base_reads: each disk layer
    once per window that loads it)."""
    if not plan.disk_layers:
        return 0.0
    from slideformer.engine.plan.allocation import Precision
    from slideformer.engine.plan.frozen import base_reads, layer_bytes
    from slideformer.engine.runtime.shapes import disk_layers, padded
    reads = base_reads(spec.num_layers, slots, disk_layers(spec.num_layers, plan.disk_layers))
    return reads * padded(layer_bytes(spec, Precision(dtype, torch.float32), method)) / 1e9


def run_ours(a: dict) -> dict:
    from slideformer.engine.config import RunConfig, override
    from slideformer.engine.models.lora import for_model, lora_spec
    from slideformer.engine.models.spec import spec_from_config
    from slideformer.engine.plan import plan_run
    from slideformer.engine.runtime.backend import make_backend
    from slideformer.engine.runtime.executor import SlidingExecutor
    from slideformer.engine.runtime.host_state import AdamHyper
    method = a["contender"].removeprefix("ours-")
    spec = spec_from_config(shape_config(a["shape"]))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pairs = a.get("objective", "sft") != "sft"  # micro_batch rows: half as many pairs
    cfg = override(RunConfig(), {"train.method": method,
                                 "train.micro_batch": a["micro_batch"] // (1 + pairs),
                                 "train.objective": a.get("objective", "sft"),
                                 "train.grad_accum": a["accum"], "data.max_seq_len": a["seq"],
                                 "data.packing": False, "budget.vram": f"{a['vram_cap']}GiB",
                                 "train.device": dev})
    if a.get("ram"):  # a RAM budget, the base partly in the NVMe tier (--disk)
        cfg = override(cfg, {"budget.ram": f"{a['ram']}GiB", "budget.nvme_dir": a["disk"] or "",
                             "budget.nvme_size": "auto" if a["disk"] else "0"})
    plan = plan_run(cfg, spec, device=dev)
    lora = for_model(lora_spec(cfg.lora), spec)  # a mixture of experts: attention only
    backend = make_backend(dev)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tier = open_tier(plan, spec, a["disk"], backend)
    t0 = time.perf_counter()
    host = random_frozen_state(spec, backend, lora, method == "qlora", dev, dtype, tier)
    setup = time.perf_counter() - t0
    hwm = {"setup": round(peak_rss(), 2)}  # where the peak RSS was reached: set-up or steps
    cap(a["vram_cap"])
    ex = SlidingExecutor(spec, backend, host, plan.exec_shape, dtype, lora=lora)
    mbs = random_batches(spec.vocab_size, a["micro_batch"], a["seq"], a["accum"])
    if pairs:
        ex.objective = (a["objective"], cfg.preference)
        mbs = as_pairs(mbs)
    times, busy, lanes, read0 = [], [], {}, 0
    for k in range(a["warmup"] + a["steps"]):
        if k == a["warmup"] and tier is not None:
            read0 = tier.bytes_read  # what the timed steps read from the NVMe tier
        hyper = lambda coef, k=k: AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, k + 1, coef)  # noqa: E731
        t = time.perf_counter()
        out = ex.train_step(mbs, hyper, 1.0)
        if dev == "cuda":  # the adapters' update is queued on the device after the backward
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if k == 0:
            hwm["first_step"] = round(peak_rss(), 2)
        spans = out.timeline.resolve()
        busy.append(sum(s.end - s.start for s in spans if s.lane == "compute") / times[-1])
        lanes = {lane: round(sum(s.end - s.start for s in spans if s.lane == lane), 4)
                 for lane in sorted({s.lane for s in spans})}  # the last step's, for calibration
    ex.close()
    read = (tier.bytes_read - read0) / 1e9 / a["steps"] if tier is not None else 0.0
    timed_s = sum(times[a["warmup"]:])
    if tier is not None:
        tier.close()
    med = statistics.median(times[a["warmup"]:])
    disk_read = planned_disk_read(plan, spec, ex.k, dtype, method)
    tokens = a["micro_batch"] * a["seq"] * a["accum"]
    return dict(tokens_per_s=round(tokens / med, 1), step_time_s=round(med, 3),
                gpu_busy=round(statistics.median(busy[a["warmup"]:]), 3), busy_last_step_s=lanes,
                planned_busy_s={k: round(v, 4) for k, v in plan.speed.busy}, slots=ex.k,
                checkpoints=plan.exec_shape.checkpoints, setup_s=round(setup, 1),
                last_loss=round(out.loss, 4), **vram(), peak_rss_gib=round(peak_rss(), 2),
                peak_rss_after_gib=hwm, planned_tokens_per_s=round(plan.speed.tokens_per_s, 1),
                planned_vram_gib=round(plan.tier("gpu").peak / GiB, 2),
                planned_host_gib=round(plan.tier("host").peak / GiB, 2), plan_verdict=plan.verdict,
                planned_on=plan.hardware.name, ram_budget_gib=a.get("ram") or None,
                disk_layers=plan.disk_layers, planned_disk_read_gb_per_step=round(disk_read, 2),
                disk_read_gb_per_step=round(read, 2),
                disk_read_gbs=round(read * a["steps"] / timed_s, 2) if read else None)


# ---- Hugging Face + PEFT -----------------------------------------------------------------------
def write_random_folder(cfg, folder: str, dev: str, dtype: torch.dtype) -> None:
    """A HF folder of N(0, 0.02) weights in ``dtype``, one tensor at a time: drawn on ``dev``,
    moved to the host and written, so the full model never sits in VRAM or RAM (the names and
    shapes come from a model built on the meta device)."""
    import transformers
    from safetensors.torch import save_file
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator(dev).manual_seed(0)
    shard, size, n, index = {}, 0, 0, {}
    for name, p in meta.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":  # the embedding serves as head
            continue
        w = (torch.randn(p.shape, generator=g, device=dev) * 0.02).to(dtype)
        if name.endswith("norm.weight"):  # RMSNorm weights start at one, as HF initialises them
            w = torch.ones(p.shape, dtype=dtype, device=dev)
        shard[name] = w.cpu()
        size += w.numel() * w.element_size()
        if size > 4 * GiB:
            n += 1
            save_file(shard, os.path.join(folder, f"model-{n:05d}.safetensors"), {"format": "pt"})
            index.update({k: f"model-{n:05d}.safetensors" for k in shard})
            shard, size = {}, 0
    if shard:
        n += 1
        save_file(shard, os.path.join(folder, f"model-{n:05d}.safetensors"), {"format": "pt"})
        index.update({k: f"model-{n:05d}.safetensors" for k in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    cfg.save_pretrained(folder)


def hf_model(a: dict, dev: str):
    """The random-init HF model: bf16 for lora; for qlora written as a bf16 folder and loaded
    through BitsAndBytesConfig (NF4, double quantisation, bf16 compute), as users load one.
    The bf16 weights never occupy the GPU before the quantised load: what is allocated after
    set-up is the 4-bit model (recorded as setup_vram_gib, also when training runs out of memory)."""
    import transformers
    kw = dict(shape_config(a["shape"]))
    arch = kw.pop("model_type", "llama")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    if arch != "llama":  # another family: its transformers class, quantised after building
        cfg = transformers.AutoConfig.for_model(arch, **kw)
        if a["contender"] == "hf-lora":
            torch.manual_seed(0)
            with torch.device(dev):
                return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
        return hf_quantised_in_place(cfg, dev, dtype)
    cfg = transformers.LlamaConfig(**kw)
    if a["contender"] == "hf-lora":
        torch.manual_seed(0)
        with torch.device(dev):
            return transformers.LlamaForCausalLM(cfg).to(dtype)
    import peft
    with tempfile.TemporaryDirectory(dir=a.get("tmp")) as d:
        write_random_folder(cfg, d, dev, dtype)
        if dev == "cuda":
            torch.cuda.empty_cache()
        q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=dtype)
        model = transformers.LlamaForCausalLM.from_pretrained(d, quantization_config=q,
                                                              dtype=dtype, device_map={"": dev})
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)


def hf_quantised_in_place(cfg, dev: str, dtype: torch.dtype):
    """The random-init model of ``cfg`` built in ``dtype`` on ``dev`` (its own initialisation),
    then every ``nn.Linear`` but the output head quantised in place, one at a time, by
    bitsandbytes into the ``Linear4bit`` that ``BitsAndBytesConfig(nf4, double quantisation,
    bf16 compute)`` loads (the layers ``from_pretrained`` quantises; the embedding and norms stay
    as they are); then PEFT's ``prepare_model_for_kbit_training``, as for the Llama contender.
    For a model whose bf16 folder would not fit the scratch space; the GPU must hold the bf16
    model during set-up, before the cap."""
    import bitsandbytes as bnb
    import peft
    import transformers
    torch.manual_seed(0)
    with torch.device(dev):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    head = model.get_output_embeddings()
    # the parents only: a list of every module would keep each replaced bf16 Linear alive
    for parent in [m for m in model.modules() if type(m) is not torch.nn.Linear]:
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear or child is head:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                  device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                         compress_statistics=True, quant_type="nf4",
                                         module=q)._quantize(dev)
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, q)
    if dev == "cuda":
        torch.cuda.empty_cache()
    model.is_loaded_in_4bit = True  # as transformers' quantiser marks a 4-bit load; PEFT reads it
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)


def run_hf(a: dict) -> dict:
    import peft
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = hf_model(a, dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=TARGETS))
    model.enable_input_require_grads()
    # from_pretrained returns the model in eval mode, where HF skips gradient checkpointing (it
    # is gated on self.training): without this the 4-bit contender kept every layer's activations
    model.train()
    return timed_steps(model, a, dev, time.perf_counter() - t0)


def timed_steps(model, a: dict, dev: str, setup: float) -> dict:
    """The HF protocol, Unsloth's too: the cap after set-up, then steps of AdamW (fused) on the
    adapters, micro-batches of ``labels = input_ids`` one after another, clipping at 1.0; tokens/s
    of the median timed step."""
    setup_vram = torch.cuda.memory_allocated() / GiB if dev == "cuda" else 0.0
    SETUP.update(setup_s=round(setup, 1), setup_vram_gib=round(setup_vram, 2))
    cap(a["vram_cap"])
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, fused=dev == "cuda")
    mbs = random_batches(model.config.vocab_size, a["micro_batch"], a["seq"], a["accum"])
    times = []
    for _ in range(a["warmup"] + a["steps"]):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            ids = mb.input_ids.to(dev)
            loss = model(input_ids=ids, labels=ids).loss / len(mbs)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    med = statistics.median(times[a["warmup"]:])
    tokens = a["micro_batch"] * a["seq"] * a["accum"]
    return dict(tokens_per_s=round(tokens / med, 1), step_time_s=round(med, 3),
                setup_s=round(setup, 1), setup_vram_gib=round(setup_vram, 2), **vram(),
                peak_rss_gib=round(peak_rss(), 2))


# ---- Unsloth ------------------------------------------------------------------------------------
def run_unsloth(a: dict) -> dict:
    """Unsloth as its users run it, on the random model: the bf16 folder of write_random_folder
    (with word_tokenizer's tokenizer, which from_pretrained loads beside the weights) loaded by
    FastLanguageModel.from_pretrained, in bf16 for lora or quantised by it on load for qlora
    (bitsandbytes NF4); then get_peft_model with the HF contender's rank, alpha and targets and
    Unsloth's gradient checkpointing, and timed_steps. The folder lives until the end of the run."""
    if not torch.cuda.is_available():
        return {"error": "skipped: Unsloth trains on a CUDA GPU only, none here"}
    os.environ.update(UNSLOTH_ENV)
    import unsloth  # noqa: I001  (first: it patches transformers, peft and trl on import)
    import transformers
    from unsloth import FastLanguageModel
    t0 = time.perf_counter()
    cfg = transformers.LlamaConfig(**shape_config(a["shape"]))
    with tempfile.TemporaryDirectory(dir=a.get("tmp")) as d:
        write_random_folder(cfg, d, "cuda", torch.bfloat16)
        word_tokenizer(cfg.vocab_size).save_pretrained(d)
        torch.cuda.empty_cache()
        model, _ = FastLanguageModel.from_pretrained(
            d, max_seq_length=a["seq"], dtype=torch.bfloat16,
            load_in_4bit=a["contender"] == "unsloth-qlora", full_finetuning=False,
            local_files_only=True, use_exact_model_name=True)
        model = FastLanguageModel.get_peft_model(
            model, r=8, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, bias="none",
            use_gradient_checkpointing="unsloth", random_state=0)
        FastLanguageModel.for_training(model)
        return dict(timed_steps(model, a, "cuda", time.perf_counter() - t0),
                    unsloth=unsloth.__version__)


# ---- TRL's DPOTrainer (+ PEFT, + bitsandbytes) -------------------------------------------------
def word_tokenizer(vocab: int):
    """A tokenizer whose words are the token ids ("t17" is id 17, "</s>" the last id), so random
    ids written as text come back from TRL's own tokenisation as exactly those ids."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = {f"t{i}": i for i in range(vocab - 1)} | {"</s>": vocab - 1}
    tk = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>",
                                                pad_token="</s>", unk_token="t0")


def run_trl(a: dict) -> dict:
    """TRL's DPOTrainer as its users run it with PEFT: LoRA of the same targets and rank on the
    random model of hf_model (bf16, or loaded in NF4 for qlora), gradient checkpointing, bf16,
    the reference log-probabilities computed before training (``precompute_ref_log_probs``: the
    adapters off, one forward pass, as ours does before step 1), clipping at 1.0. A step holds
    micro_batch / 2 pairs x accum, each pair a prompt of seq / 2 tokens and two responses of
    seq / 2 (EOS included), the same tokens as ours. Step time: from one optimizer step's end
    to the next (data collation included), after a CUDA synchronise."""
    import datasets
    import peft
    import transformers
    import trl
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = hf_model(dict(a, contender=a["contender"].replace("trl-", "hf-")), dev)
    model.config.use_cache = False
    cap(a["vram_cap"])  # the reference pass runs under the cap too
    V, half = model.config.vocab_size, a["seq"] // 2
    pairs = a["micro_batch"] // 2
    n = pairs * a["accum"] * (a["warmup"] + a["steps"])
    g = torch.Generator().manual_seed(1)
    text = lambda k: " ".join(f"t{i}" for i in torch.randint(1, V - 1, (k,), generator=g).tolist())  # noqa: E731
    rows = {"prompt": [text(half) for _ in range(n)],
            "chosen": [" " + text(half - 1) + " </s>" for _ in range(n)],
            "rejected": [" " + text(half - 1) + " </s>" for _ in range(n)]}
    # A fingerprint of our own: datasets 5.0 hashes a new table by pickling it with dill, which
    # fails on Python 3.12 with pyarrow 26 ("Can't pickle <class 'MonthDayNano'>").
    ds = datasets.Dataset(datasets.table.InMemoryTable.from_pydict(rows), fingerprint="lora-bench")
    times: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, *args, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kw):
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)
            self.t = time.perf_counter()

    with tempfile.TemporaryDirectory(dir=a.get("tmp")) as out:
        args = trl.DPOConfig(
            output_dir=out, per_device_train_batch_size=pairs, gradient_accumulation_steps=a["accum"],
            max_length=a["seq"], beta=0.1, loss_type=["sigmoid"], learning_rate=1e-4,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
            max_steps=a["warmup"] + a["steps"], bf16=dev == "cuda", use_cpu=dev == "cpu",
            gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
            precompute_ref_log_probs=True, logging_steps=10**6, save_strategy="no",
            report_to="none", dataloader_num_workers=0, seed=0)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=ds,
                                 processing_class=word_tokenizer(V), callbacks=[Timer()],
                                 peft_config=peft.LoraConfig(r=8, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=TARGETS))
        setup = time.perf_counter() - t0
        SETUP.update(setup_s=round(setup, 1))
        tokens_seen = sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"])
                          for r in trainer.train_dataset.select(range(pairs * a["accum"])))
        trainer.train()
    med = statistics.median(times[a["warmup"]:])
    tokens = a["micro_batch"] * a["seq"] * a["accum"]
    assert tokens_seen == tokens, f"TRL's first step holds {tokens_seen} tokens, ours {tokens}"
    return dict(tokens_per_s=round(tokens / med, 1), step_time_s=round(med, 3),
                setup_s=round(setup, 1), **vram(), peak_rss_gib=round(peak_rss(), 2),
                trl=trl.__version__)


# ---- driver ------------------------------------------------------------------------------------
def one(a: dict) -> None:
    try:
        res = run_ours(a) if a["contender"].startswith("ours") else \
            run_trl(a) if a["contender"].startswith("trl") else \
            run_unsloth(a) if a["contender"].startswith("unsloth") else run_hf(a)
    except torch.cuda.OutOfMemoryError as e:
        res = {**SETUP, "error": f"out of memory: {str(e).splitlines()[0]}"}
    except ImportError as e:
        res = {"error": f"not installed: {e}"}
    print(MARK + json.dumps({**a, **res}), flush=True)


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.cuda.is_available() and torch.cuda.get_device_name(0)}
    for mod in ("transformers", "peft", "bitsandbytes", "trl"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table", choices=TABLES, default="8b")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on a tiny shape")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vram-cap", type=float, default=24.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", help="also append the JSON records to this file")
    ap.add_argument("--tokens", type=int, help="only the size with this many tokens per step "
                    "(e.g. 16384), to split a table over calls of limited length")
    ap.add_argument("--only", help="comma-separated contenders of the table to run (default: all)")
    ap.add_argument("--ram", type=float, default=0.0,
                    help="our runs' RAM budget in GiB (budget.ram; 0: auto)")
    ap.add_argument("--disk", default="", help="folder of our NVMe tier (budget.nvme_dir): with "
                    "--ram, the frozen base layers the plan puts on disk are written there")
    ap.add_argument("--objective", choices=("sft", "dpo", "simpo", "orpo"), default="sft",
                    help="a preference objective; with dpo the HF contenders are TRL's "
                         "DPOTrainer + PEFT (+ bitsandbytes) (a micro-batch's rows are half as "
                         "many pairs, half of each row the prompt)")
    ap.add_argument("--sizes", help="micro-batch x accumulation pairs instead of the table's, "
                    "e.g. 1x1 (with --seq 65536: one 64K-token sequence a step)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(json.loads(args.one))
    shape, contenders, sizes = TABLES[args.table]
    seq = args.seq
    if args.tiny:
        tiny = {"gpt_oss": "small-gpt-oss", "qwen3_moe": "small-moe", "gemma4_text": "small-gemma4",
                "qwen3_5_text": "small-qwen3.5", "qwen3_5_moe_text": "small-qwen3.5"}.get(
            SHAPES[shape].get("model_type"), "tiny")
        shape, seq, sizes = tiny, 32, tuple((2, acc // 4 or 1) for _, acc in sizes)
    print(json.dumps({"versions": versions(), "table": args.table, "shape": shape}))
    if args.only:
        contenders = tuple(c for c in contenders if c in args.only.split(","))
    if args.sizes:
        sizes = tuple(tuple(int(v) for v in p.split("x")) for p in args.sizes.split(","))
    if args.tokens:
        sizes = tuple((mb, acc) for mb, acc in sizes if mb * seq * acc == args.tokens)
    rows = []
    for mb, acc in sizes:
        for c in contenders:
            if args.objective != "sft" and not c.startswith("ours"):
                if args.objective != "dpo" or c.startswith("unsloth"):
                    continue  # TRL's DPOTrainer is the contender of DPO only
                c = c.replace("hf-", "trl-")  # Hugging Face's side of DPO: TRL + PEFT (+ bnb)
            a = dict(contender=c, shape=shape, seq=seq, micro_batch=mb, accum=acc, tmp=SCRATCH,
                     vram_cap=args.vram_cap, warmup=args.warmup, steps=args.steps,
                     objective=args.objective, ram=args.ram, disk=args.disk)
            for rec in attempts(a):
                rows.append(rec)
                print(json.dumps(rec), flush=True)
                if args.out:
                    with open(args.out, "a", encoding="utf-8") as f:
                        f.write(json.dumps(rec) + "\n")
    print(table(rows))


def attempts(a: dict):
    """Run one contender in a fresh process; an HF or Unsloth contender out of VRAM is retried
    with half the micro-batch and twice the accumulation (same tokens per step), down to
    micro-batch 1, since that is what its users would do. Every attempt is a record."""
    while True:
        p = subprocess.run([sys.executable, __file__, "--one", json.dumps(a)],
                           capture_output=True, text=True)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
        rec = json.loads(lines[-1][len(MARK):]) if lines else {
            **a, "error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}",
            "stderr_tail": p.stderr.strip().splitlines()[-25:]}  # the traceback, for the log
        yield rec
        oom = "out of memory" in rec.get("error", "")
        # TRL's micro-batch counts pairs: 2 rows at least
        if not (oom and a["contender"].startswith(("hf", "trl", "unsloth")) and
                a["micro_batch"] > 1 + a["contender"].startswith("trl")):
            return
        a = dict(a, micro_batch=a["micro_batch"] // 2, accum=a["accum"] * 2)


def table(rows: list[dict]) -> str:
    head = ("contender", "tokens/step", "tok/s", "GPU busy", "VRAM alloc / reserved GiB",
            "RSS GiB", "planned tok/s", "planned VRAM / host GiB")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        tok = r["micro_batch"] * r["seq"] * r["accum"]
        if "error" in r:
            out.append(f"| {r['contender']} | {tok:,} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        plan = (f"{r['planned_tokens_per_s']:,.0f}", f"{r['planned_vram_gib']} / {r['planned_host_gib']}") \
            if "planned_tokens_per_s" in r else ("-", "-")
        out.append(f"| {r['contender']} | {tok:,} | {r['tokens_per_s']:,.0f} | {r.get('gpu_busy', '-')} "
                   f"| {r['peak_vram_alloc_gib']} / {r['peak_vram_reserved_gib']} | {r['peak_rss_gib']} "
                   f"| {plan[0]} | {plan[1]} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
