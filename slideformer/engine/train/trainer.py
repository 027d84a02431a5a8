"""The Trainer: ``setup / train / save_checkpoint / cleanup``, driven by a RunConfig.

Front ends call :meth:`Trainer.pause`, :meth:`Trainer.resume` and :meth:`Trainer.stop` from
another thread; they take effect between steps. Everything the run reports goes through events
(``slideformer.engine.events``) to the callbacks and to ``<run dir>/events.jsonl``.

A run ends in one of three states: ``finished``; ``stopped`` (asked to; saved unless told not
to); ``failed``: the engine stopped it because it could not go on -- a checkpoint or the export
could not be written (disk full), the GPU ran out of memory, or three steps in a row had a
non-finite loss or gradients. A failed run says why and what to change, keeps every complete
checkpoint, saves its state when that state is sound, exports nothing, and continues with
``--resume``.
"""
from __future__ import annotations

import math
import os
import resource
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.config import RunConfig, parse_bytes
from slideformer.engine.dist.ranks import Solo, gpu_count, host_alloc, rank_shape, start_ranks
from slideformer.engine.devices import (check_fp8, compute_dtype_name, device_kind,
                                        moments_torch_dtype, residual_dtype_name, torch_dtype)
from slideformer.engine.errors import UserError
from slideformer.engine.events import (CheckpointSaved, EvalMetrics, EventSink, Log, PairMetrics,
                                      RolloutMetrics, RunState, StepMetrics, Timeline,
                                      read_events)
from slideformer.engine.kernels import cpu_adam
from slideformer.engine.kernels.attention import take_flex_fallback
from slideformer.engine.models.lora import for_model
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tokenizer import check_vocab, load_tokenizer
from slideformer.engine.models.weights import Checkpoint
from slideformer.engine.plan.planner import Plan, plan_run
from slideformer.engine.runtime.backend import make_backend
from slideformer.engine.runtime.executor import SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.nvme import NvmeTier
from slideformer.engine.runtime.shapes import ExecShape, borrowed_layers, device_items, disk_layers
from slideformer.engine.train import resume as resume_rules
from slideformer.engine.train.checkpoint import (CorruptCheckpoint, checkpoint_bytes, checkpoints,
                                                 load_newest, newest_meta, read_state, rotate,
                                                 rng_state, set_rng_state, write_checkpoint,
                                                 write_error)
from slideformer.engine.tracking import Trackers, check_installed
from slideformer.engine.train.objectives import NEEDS_REFERENCE
from slideformer.engine.train.lock import LOCK_FILE, RunLock, run_owner
from slideformer.engine.train.schedule import lr_at, run_steps
from slideformer.engine.train.state import (build_frozen_state, build_host_state, export_model,
                                load_weights, state_tensors)
from slideformer.engine.validate import validate
from slideformer.engine.models.lora import lora_spec
from slideformer.engine.runtime.lora import init_adapters, is_adapter
from slideformer.engine.train.space import check_space, export_bytes
from slideformer.engine.train.lora_export import write_adapter, write_merged

GiB = 1 << 30
REFERENCE_FILE = "reference-logps.npy"
"""A preference run's reference log-probabilities (N pairs x chosen, rejected), written once
before its first step: every checkpoint of the run needs it to resume."""
RUN_FILES = {"events.jsonl", "engine.log", "control", "config.toml", "checkpoints", LOCK_FILE,
             REFERENCE_FILE}
"""What a run leaves in its folder before its first complete checkpoint: with nothing else
there (and no complete checkpoint), the folder may start a new run."""
NONFINITE_LIMIT = 3
"""Steps in a row with a non-finite loss or gradients before the run stops."""
MEMORY_FIX = ("set budget.checkpoints = \"host\" or a smaller budget.slots (the run stays "
              "resumable), or a smaller train.micro_batch (a new run); close other programs "
              "that use the GPU")
RESUME = "then continue with --resume"


def peak_rss() -> int:
    """Peak resident memory of this process in bytes.

    Linux's ``VmHWM`` where there is one: ``ru_maxrss`` of a process started by another
    (fork + exec) can report the parent's larger peak, e.g. the desktop app's.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    """Fine-tunes a model with the sliding-window executor."""

    def __init__(self, cfg: RunConfig, callbacks=()):
        self.cfg = cfg
        self.callbacks = list(callbacks)
        self.run_dir = Path(cfg.output.run_dir)
        self.step = 0
        self._pause = threading.Event()
        self._stop = threading.Event()
        self._stop_save = True
        self._failure: tuple[str, bool] | None = None
        """Why the run cannot go on (message with its fix), and whether to save first."""
        self._saved_step = -1
        self.executor = None
        self.ranks = Solo()
        """The other ranks of a run on several GPUs (slideformer.engine.dist.ranks)."""
        self.tier = None
        self.sink = None
        self.trackers = None
        self.lock = RunLock(self.run_dir)
        self.best: tuple[int, float] | None = None
        """(step, validation loss) of the lowest validation loss so far."""
        self.evals_without_gain = 0
        """Evaluations in a row that did not improve on ``best`` (early stopping counts them)."""
        self._stopped_early = ""
        self._evaluated_at = -1
        self.depends: dict = {}
        """What the checkpoints record of the model, compute dtype and data (_depends)."""

    # ---- control from other threads ---------------------------------------------------------
    def pause(self) -> None:
        self._pause.set()

    def resume(self) -> None:
        self._pause.clear()

    def stop(self, save: bool = True) -> None:
        """Stop after the current step; save a checkpoint and the final model if ``save``."""
        self._stop_save = save
        self._stop.set()
        self._pause.clear()

    def emit(self, ev) -> None:
        self.sink.emit(ev)

    # ---- setup ------------------------------------------------------------------------------
    def setup(self, resume: bool = False, data=None) -> None:
        """Load the model, data and state; ``data`` (prepared, stream) overrides slideformer.engine.data.

        Everything that can be checked without loading comes first: the run folder, the
        settings, the plan (a run whose host state cannot fit host RAM is refused here).
        """
        cfg = self.cfg
        validate(cfg, "train" if data is None else "plan")
        check_installed(cfg.output.report_to)
        self.lora = None if cfg.train.method == "full" else lora_spec(cfg.lora)
        self._check_run_dir(resume)
        if resume:  # before the first event: a refused resume leaves the run folder as it was
            self.depends = self._depends(data is None)
            meta = newest_meta(self.run_dir / "checkpoints")
            if meta is not None:
                resume_rules.check(meta, cfg, self.depends)
        self.sink = EventSink(self.run_dir / "events.jsonl", self.callbacks)
        self.emit(RunState("setup", "loading model and data"))
        self.spec = load_spec(cfg.model.path)
        if self.lora is not None:
            self.lora = for_model(self.lora, self.spec)
        # headers only: weights that do not match config.json are named before any plan blames
        # the budgets for the sizes config.json claims
        Checkpoint(cfg.model.path).check(self.spec)
        self.backend = make_backend(cfg.train.device)
        compute = compute_dtype_name(cfg.train.compute_dtype, "cuda" if self.backend.is_cuda else "cpu")
        self.dtype = torch_dtype(compute)
        residual = torch_dtype(residual_dtype_name(cfg.train.precision, compute))
        moments = moments_torch_dtype(cfg.optim.moments_dtype)
        if cfg.train.precision == "fp8":
            check_fp8(compute, self.backend.device, self.spec)
        self.world = gpu_count(cfg)
        shape = rank_shape(self.make_plan().exec_shape, self.world)
        self._check_host_memory()
        self.tok = load_tokenizer(cfg.model.path)
        check_vocab(self.tok, self.spec.vocab_size, Path(cfg.model.path) / "config.json")
        self.prepared, self.stream = data if data is not None else self._prepare_data()
        if shape.rollout_prompts:  # GRPO: as many prompts' groups at once as the plan fits
            self.stream.together = shape.rollout_prompts
        if not resume:  # the data as this run read it (the digests come from the cache's memo)
            self.depends = self._depends(data is None)
        self.total_steps = run_steps(cfg.train, self.stream.steps_per_epoch)
        self.tier = self._open_tier()
        self._build_state(shape, moments, resume)
        self._check_disk(resume)
        self.ranks = start_ranks(cfg, self.host, shape, self.dtype, self.world,
                                 self.backend.is_cuda)
        self.executor = SlidingExecutor(self.spec, self.backend, self.host, shape, self.dtype,
                                        self.lora, cfg.train.seed, self.ranks.group, residual,
                                        fp8=cfg.train.precision == "fp8")
        if cfg.train.objective == "grpo":
            self.executor.objective = ("grpo", cfg.grpo)
            from slideformer.engine.train.grpo import Sampler
            self.stream.policy = Sampler(self.spec, self.host, self.lora, self.backend, self.dtype,
                                         self.tok, cfg.grpo, cfg.data.max_seq_len,
                                         self.executor)
        elif cfg.train.objective != "sft":
            self.executor.objective = (cfg.train.objective, cfg.preference)
        if cpu_adam.unavailable_reason() and self.lora is None:
            self.emit(Log("warning", f"compiled CPU AdamW unavailable "
                                     f"({cpu_adam.unavailable_reason()}): the PyTorch fallback "
                                     "does the CPU updates, about 3x slower"))
        if resume:
            self._restore()
            if self.step >= self.total_steps and self._exported_at(self.step):
                raise UserError(self.run_dir, f"has finished: its newest checkpoint is step "
                                f"{self.step} of {self.total_steps}",
                                f"to train on, resume with more steps, e.g. --max-steps "
                                f"{2 * self.step}; the fine-tuned model is in {self.run_dir / 'final'}")
        if NEEDS_REFERENCE.get(cfg.train.objective):
            self._reference(resume)
        _write_atomic(self.run_dir / "config.toml", config_mod.dumps(cfg))
        if cfg.output.report_to:
            self.trackers = Trackers(cfg.output.report_to, self.run_dir, config_mod.to_dict(cfg),
                                     lambda text: self.emit(Log("warning", text)))
            self.sink.callbacks.append(self.trackers)
        executor = replace(shape, slots=self.executor.k).describe(
            "GPU" if self.backend.is_cuda else "CPU")
        self.emit(Log("info", f"{self.spec.model_type}: {self.spec.num_params:,} parameters, "
                              f"{self.spec.num_layers} layers, {self.dtype}, "
                              f"{self.total_steps} steps; executor: {executor}"
                              + (f", {self.world} ranks (a process each, one host state)"
                                 if self.world > 1 else "")))

    def _build_state(self, shape: ExecShape, moments: torch.dtype, resume: bool) -> None:
        """The host state: every item trained (full), or a frozen base (always read from the
        model folder: checkpoints do not hold it) with adapters, initialised unless resumed."""
        cfg = self.cfg
        if self.lora is None:
            L = self.spec.num_layers
            borrowed = borrowed_layers(shape, L, disk_layers(L, self.plan.disk_layers))
            self.host = build_host_state(self.spec, host_alloc(self.backend, self.world),
                                         self.dtype, moments, self.tier,
                                         layer_grads=cfg.optim.max_grad_norm > 0,
                                         borrowed=borrowed, on_device=device_items(shape, L))
        else:
            self.host = build_frozen_state(self.spec, self.backend, self.dtype, moments, self.lora,
                                           nf4=cfg.train.method == "qlora", tier=self.tier)
        if not (resume and self.lora is None):  # else the checkpoint holds the whole state
            load_weights(self.host, self.spec, cfg.model.path, self.emit)
        if self.lora is not None and not resume:
            init_adapters({k: v for k, v in self.host.items() if is_adapter(k)}, cfg.train.seed)

    def make_plan(self) -> Plan:
        """Run the planner for this run and keep its answer as ``self.plan``; a plan that does
        not fit is a warning here (the host-memory check refuses what cannot run).

        The plan's executor shape (slots, checkpoint placement, LM-head chunk) is what the
        executor runs, so prediction and run cannot drift apart; budget.slots and
        budget.checkpoints, when set, override the plan's choice.
        """
        self.plan = plan_run(self.cfg, self.spec, device="cuda" if self.backend.is_cuda else "cpu",
                             speculate=gpu_count(self.cfg) == 1)  # ranks do not speculate (rank_shape)
        if self.plan.verdict == "does not fit":
            fix = f"; try: {self.plan.fixes[0].change}" if self.plan.fixes else ""
            self.emit(Log("warning", f"the planner predicts this run does not fit: "
                                     f"{self.plan.reason}{fix}"))
        return self.plan

    def _open_tier(self) -> NvmeTier | None:
        """The NVMe tier for the layers whose moments (full) or frozen base weights (lora,
        qlora) the plan put on disk (None: none)."""
        n, L = self.plan.disk_layers, self.spec.num_layers
        if not n:
            return None
        what = "AdamW moments" if self.lora is None else "frozen base weights"
        self.emit(Log("info", f"NVMe tier: {what} of {n} of {L} layers in "
                              f"{self.cfg.budget.nvme_dir}"))
        return NvmeTier(self.cfg.budget.nvme_dir, [f"layer{i}" for i in disk_layers(L, n)],
                        size_limit=self.plan.budgets.disk,  # a base's buffers go to the GPU
                        pin=None if self.lora is None else self.backend.pin_mapping)

    def _check_run_dir(self, resume: bool) -> None:
        d = self.run_dir
        if d.exists() and not d.is_dir():
            raise UserError(d, "is a file, not a run folder", "choose another output.run_dir")
        if d.is_dir() and run_owner(d) is not None:
            self.lock.acquire()  # raises, naming the process that trains this folder
        has_checkpoint = bool(checkpoints(d / "checkpoints"))
        if resume and not has_checkpoint:
            raise UserError(d, "has no checkpoint to resume from",
                            "start a new run without --resume (into an unused output.run_dir)")
        foreign = {p.name for p in d.iterdir()} - RUN_FILES if d.is_dir() else set()
        if not resume and (has_checkpoint or foreign):
            raise UserError(d, "already holds a run", "resume it (--resume) or choose another "
                            "output.run_dir" if has_checkpoint else "choose another output.run_dir")
        if (d / "checkpoints").exists() and not (d / "checkpoints").is_dir():
            raise UserError(d / "checkpoints", "is a file, not the run's checkpoint folder",
                            "move the file away, or choose another output.run_dir")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(d, f"cannot be created ({e.strerror})",
                            "choose an output.run_dir in a folder you can write to") from None
        self.lock.acquire()  # held until cleanup(); the OS drops it if this process dies

    def _check_host_memory(self) -> None:
        """Refuse a run the plan says cannot fit host RAM, before anything is loaded."""
        host = self.plan.tier("host")
        if host.budget is not None and host.peak > host.budget:
            fixes = [f.change for f in self.plan.fixes if f.tier == "host" and f.fits]
            raise UserError("budget.ram", f"the run needs {host.peak / GiB:.2f} GiB of host RAM "
                            f"and {host.budget / GiB:.2f} GiB is available (budget.ram: "
                            f"{self.plan.budgets.ram_source})",
                            (fixes[0] if fixes else "use optim.moments_dtype = \"bfloat16\" or a "
                             "smaller model") + ", free host memory, or raise budget.ram")

    def _reference(self, resume: bool) -> None:
        """DPO's reference: the response log-probabilities of every pair under the initial
        weights (for lora / qlora the base, since the adapters start at zero: the same model),
        one forward pass before the first step, kept in the run folder for resumes."""
        path = self.run_dir / REFERENCE_FILE
        n = len(self.stream.pairs)
        if resume:
            try:
                ref = np.load(path)
            except (OSError, ValueError) as e:
                raise UserError(path, f"cannot be read ({e}): the run's reference "
                                "log-probabilities are lost", "start a new run folder (the "
                                "reference must come from the starting weights)") from None
            if ref.shape != (n, 2):
                raise UserError(path, f"holds {ref.shape[0]} pairs, the data {n}",
                                "resume with the data of the checkpointed run")
        else:
            self.emit(RunState("setup", f"reference log-probabilities of {n:,} pairs"))
            t0, ref = time.perf_counter(), np.zeros((n, 2), np.float32)
            size = max(1, self.cfg.train.micro_batch)
            for mb in self.stream.batches(size):
                lp = self.executor.row_logps(mb).numpy()
                ref[mb.pairs, 0], ref[mb.pairs, 1] = lp[:len(mb.pairs)], lp[len(mb.pairs):]
            tmp = path.with_name(path.name + ".tmp.npy")
            np.save(tmp, ref)
            os.replace(tmp, path)
            self.emit(Log("info", f"reference log-probabilities of {n:,} pairs in "
                                  f"{time.perf_counter() - t0:.1f} s"))
        self.stream.reference = ref

    def _prepare_data(self):
        from slideformer.engine.data import BatchStream, prepare_data
        if self.cfg.train.objective == "grpo":
            from slideformer.engine.data.chat import ChatRenderer
            from slideformer.engine.train.grpo import GrpoStream, read_prompts
            d, t = self.cfg.data, self.cfg.train
            prompts = read_prompts(d, self.tok, ChatRenderer(self.tok, d.chat_template,
                                                             d.enable_thinking))
            self.emit(Log("info", f"{d.train}: {len(prompts):,} prompts"))
            return prompts, GrpoStream(prompts, self.cfg.grpo, t.micro_batch, t.grad_accum,
                                       d.seed, d.max_seq_len, self.tok.pad_id or 0, self.tok)
        if self.cfg.train.objective != "sft":
            from slideformer.engine.data.preference import PairStream, read_pairs
            pairs = read_pairs(self.cfg.data, self.tok, self.emit, self.cfg.train.objective == "kto")
            t = self.cfg.train
            return pairs, PairStream(pairs.pairs, t.micro_batch, t.grad_accum, self.cfg.data.seed,
                                     self.cfg.data.max_seq_len, self.tok.pad_id or 0)
        cache = self.run_dir.parent / ".token-cache"
        prepared = prepare_data(self.cfg.data, self.tok, cache, self.emit)
        t = self.cfg.train
        return prepared, BatchStream(prepared.train, micro_batch=t.micro_batch,
                                     grad_accum=t.grad_accum, seed=self.cfg.data.seed)

    # ---- training ---------------------------------------------------------------------------
    def hyper(self, coef: float) -> AdamHyper:
        o = self.cfg.optim
        return AdamHyper(lr=lr_at(self.step + 1, self.total_steps, o), beta1=o.beta1,
                         beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay,
                         step=self.step + 1, grad_scale=coef)

    def train(self) -> str:
        """Run until the last step or a stop; returns the final state."""
        self.emit(RunState("running", step=self.step))
        cfg, skipped_in_row = self.cfg, 0
        while self.step < self.total_steps and not self._stop.is_set():
            if self._pause.is_set():
                self.emit(RunState("paused", step=self.step))
                while self._pause.is_set() and not self._stop.is_set():
                    time.sleep(0.05)
                if self._stop.is_set():
                    break
                self.emit(RunState("running", step=self.step))
            out = self._one_step()
            if out is None:
                break
            skipped_in_row = skipped_in_row + 1 if out.skipped else 0
            if skipped_in_row >= NONFINITE_LIMIT:
                self._fail(f"{NONFINITE_LIMIT} steps in a row had a non-finite loss or gradients; "
                           f"the state before them is kept", "lower optim.lr, raise "
                           "optim.warmup_steps or keep optim.max_grad_norm > 0, and check the "
                           f"data for broken records; {RESUME}", save=True)
                break
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                self.evaluate()  # first: the checkpoint below then holds its outcome
            every = cfg.train.save_every
            if every and self.step % every == 0 and self.step < self.total_steps:
                self.save_checkpoint()
        return self._finish()

    def _one_step(self):
        """One optimizer step; None when the GPU ran out of memory (the run then fails)."""
        self.backend.reset_peak()
        t0 = time.perf_counter()
        position = self.stream.state_dict()
        mbs = self.stream.next_step()
        data_time = time.perf_counter() - t0
        lr = self.hyper(1.0).lr  # the rate this step uses (the step counter moves below)
        self.ranks.start_step(mbs, self.hyper(1.0))
        try:
            out = self.executor.train_step(mbs, self.hyper, self.cfg.optim.max_grad_norm)
        except torch.cuda.OutOfMemoryError:
            self._out_of_memory(position)
            return None
        dt = time.perf_counter() - t0
        if not out.skipped:
            self.step += 1
        seen = sum(mb.input_ids.numel() for mb in mbs)
        self.emit(StepMetrics(step=self.step, total_steps=self.total_steps,
                              loss=None if out.skipped else out.loss, lr=lr,
                              grad_norm=out.grad_norm if math.isfinite(out.grad_norm) else None,
                              tokens=out.tokens, tokens_per_s=seen / dt, step_time=dt,
                              peak_vram=self.backend.peak_memory(), peak_ram=peak_rss(),
                              skipped=out.skipped, data_time=data_time))
        if out.skipped and out.applied:
            self.emit(Log("warning", f"non-finite gradients: step skipped, but {out.applied} layer "
                                     "updates had already been applied (without clipping, updates "
                                     "overlap the backward; optim.max_grad_norm > 0 skips whole "
                                     "steps)"))
        elif out.skipped:
            self.emit(Log("warning", "non-finite loss or gradients: step skipped, weights "
                                     "unchanged"))
        if out.pairs is not None and not out.skipped:
            p = out.pairs
            self.emit(PairMetrics(self.step, p.accuracy, p.chosen, p.rejected, p.margin))
        rollout = getattr(self.stream, "last", None)
        if rollout is not None:
            self.emit(RolloutMetrics(self.step, rollout.reward_mean, rollout.reward_std,
                                     rollout.reply_tokens, rollout.seconds))
        notice = take_flex_fallback()
        if notice:
            self.emit(Log("warning", notice))
        if self._last_timeline is not None:
            self.emit(Timeline(self._last_timeline[0], self._last_timeline[1].resolve()))
        self._last_timeline = (self.step, out.timeline)
        return out

    _last_timeline = None

    def _out_of_memory(self, position: dict) -> None:
        """Roll the failed step back: its batch is put back, the state is the previous step's.

        With clipping the step's speculative updates are undone, so the host state is the
        previous step's, unless the out-of-memory error came in the second pass of regenerated
        gradients, whose updates run as it goes; without clipping, updates overlap the backward
        and some may have been applied."""
        self.executor.roll_back()  # the last step's updates finish, this one's are undone
        self.executor.drain()
        self.stream.load_state_dict(position)
        plan = getattr(self, "plan", None)
        fixes = [f.change for f in getattr(plan, "fixes", ()) if f.available][:2]
        fix = "; or ".join(fixes + [MEMORY_FIX])
        applied = self.executor.step_updates
        if applied:
            self._fail(f"out of GPU memory in step {self.step + 1} after {applied} of its updates "
                       f"were applied (updates overlap the backward without clipping, and the "
                       f"second pass of regenerated gradients with it): this state "
                       f"is not saved, the newest checkpoint is where to continue",
                       f"{fix}; {RESUME}", save=False)
        else:
            self._fail(f"out of GPU memory in step {self.step + 1}; the step was rolled back",
                       f"{fix}; {RESUME}", save=True)

    def _fail(self, message: str, fix: str, save: bool) -> None:
        """Stop the run as failed after this step, saving its state first if ``save``.

        The run's last event (RunState "failed") carries the message; an earlier failure that
        a later one replaces (the save after it failed too) is kept as an error log line.
        """
        if self._failure is not None:
            self.emit(Log("error", self._failure[0]))
        self._failure = (f"{message}\n  fix: {fix}", save)
        self._stop.set()

    def evaluate(self) -> float | None:
        """Mean validation loss over the validation split (None without one)."""
        if getattr(self.prepared, "val", None) is None:
            return None
        from slideformer.engine.data import iterate_eval
        total = count = 0.0
        try:
            for mb in iterate_eval(self.prepared.val, self.cfg.train.micro_batch):
                loss_sum, n = self.executor.eval_loss(mb)
                total, count = total + loss_sum, count + n
        except torch.cuda.OutOfMemoryError:
            self.emit(Log("warning", "validation skipped: out of GPU memory"))
            return None
        if not count:
            return None
        val = total / count
        self._evaluated_at = self.step
        self.emit(EvalMetrics(self.step, val))
        self._judge(val)
        return val

    def _judge(self, val: float) -> None:
        """Track the best validation loss: keep its checkpoint (output.keep_best) and stop the
        run when train.early_stopping_patience evaluations in a row did not improve on it."""
        t, best = self.cfg.train, self.best
        if best is None or best[1] - val > t.early_stopping_threshold:
            self.evals_without_gain = 0
        else:
            self.evals_without_gain += 1
        if best is None or val < best[1]:
            self.best = (self.step, val)
            if self.cfg.output.keep_best:
                self.save_checkpoint()
        patience = t.early_stopping_patience
        if patience and self.evals_without_gain >= patience and self.step < self.total_steps:
            step, loss = self.best
            self._stopped_early = (f"stopped early at step {self.step}: {patience} evaluations "
                                   f"in a row did not improve the validation loss (best "
                                   f"{loss:.4f} at step {step})")
            self._stop_save = True
            self._stop.set()

    def _finish(self) -> str:
        self.executor.drain()
        if self._last_timeline is not None:
            self.emit(Timeline(self._last_timeline[0], self._last_timeline[1].resolve()))
            self._last_timeline = None
        if self._failure is None and self._stop.is_set() and not self._stop_save:
            self.emit(RunState("stopped", "stopped without saving", self.step))
            return "stopped"
        if self._failure is None and self._evaluated_at != self.step:
            self.evaluate()
        if self._failure is None or self._failure[1]:
            self.save_checkpoint()  # first: an export that fails must not lose the trained steps
        if self._failure is None:
            self.emit(RunState("saving", "exporting the final model", self.step))
            out = self.run_dir / "final"
            try:
                exported = self._take_best()
                self.export(out)
            except OSError as e:
                self._fail(f"could not write the final model to {out}: "
                           f"{write_error(e, self.run_dir)}; the trained state is safe in "
                           f"checkpoints/step-{self.step}", "free disk space, then run the same "
                           "command with --resume: it writes the final model without training "
                           "again", save=False)
        if self._failure is not None:
            self.emit(RunState("failed", self._failure[0], self.step))
            return "failed"
        done = self.step >= self.total_steps or bool(self._stopped_early)
        hint = "" if done else f"; {RESUME} to train on"
        early = f"{self._stopped_early}; " if self._stopped_early else ""
        self.emit(RunState("finished" if done else "stopped",
                           f"{early}model saved to {out}{exported}{hint}", self.step))
        return "finished" if done else "stopped"

    def _take_best(self) -> str:
        """With output.keep_best, load the best checkpoint's state to export it (the last
        step's state is already in its own checkpoint); says which state is exported ("": the
        last step's)."""
        if not (self.cfg.output.keep_best and self.best is not None):
            return ""
        step, loss = self.best
        what = f" (the best checkpoint: step {step}, validation loss {loss:.4f})"
        if step == self.step:
            return what
        folder = self.run_dir / "checkpoints" / f"step-{step}"
        try:
            read_state(folder, state_tensors(self.host))
        except (CorruptCheckpoint, UserError) as e:
            load_newest(self.run_dir / "checkpoints", state_tensors(self.host), lambda m: None,
                        lambda text: None)  # back to the last step's state
            self.emit(Log("warning", f"the best checkpoint {folder} cannot be read ({e}): the "
                                     f"last step's state is exported instead"))
            return ""
        self.executor.host_changed()
        return what

    def _check_disk(self, resume: bool) -> None:
        """The run folder's disk holds a checkpoint and the final model (train.space)."""
        lora = None if self.lora is None else self.cfg.lora.export_merged
        check_space(self.run_dir, checkpoint_bytes(state_tensors(self.host)),
                    export_bytes(self.spec, self.host, lora),
                    self.cfg.train.keep_checkpoints + self.cfg.output.keep_best,
                    resume, lambda text: self.emit(Log("warning", text)))

    def export(self, out_dir: Path) -> Path:
        """The trained model (full), or the PEFT adapter folder (lora, qlora) and, with
        lora.export_merged, the merged model in ``<out_dir>-merged``."""
        self.executor.drain()
        dtype = torch_dtype(self.spec.torch_dtype) or torch.bfloat16
        shard = parse_bytes(self.cfg.output.shard_size, "output.shard_size")
        base = self.cfg.model.path
        if self.lora is None:
            return export_model(self.host, self.spec, out_dir, base, dtype, shard)
        if self.cfg.lora.export_merged:
            write_merged(out_dir.with_name(out_dir.name + "-merged"), self.host, self.spec,
                         self.lora, base, dtype, shard)
        return write_adapter(out_dir, self.host, self.spec, self.lora, base)

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write checkpoints/step-N crash-safely (slideformer.engine.train.checkpoint) and keep the last N.

        Returns None when it cannot be written (e.g. the disk is full): every earlier
        checkpoint is left intact and the run stops as failed, saying so.
        """
        self.executor.drain()
        root = self.run_dir / "checkpoints"
        if self._saved_step == self.step:
            return root / f"step-{self.step}"
        items = state_tensors(self.host)
        try:
            best = self._best_step()
            path = write_checkpoint(root, self.step, items, self._trainer_state(),
                                    self.cfg.train.keep_checkpoints, protect=best)
        except OSError as e:
            newest = checkpoints(root)
            kept = f"the newest complete checkpoint is {newest[0].name}" if newest else \
                "there is no complete checkpoint yet"
            then = RESUME if newest else ("then run the same command again without --resume "
                                          "(no checkpoint holds this run's steps)")
            self._fail(f"could not write checkpoint step-{self.step} in {root}: "
                       f"{write_error(e, root, checkpoint_bytes(items))}; {kept}",
                       "free disk space (or lower train.keep_checkpoints, or move "
                       f"output.run_dir to a larger disk), {then}", save=False)
            return None
        self._saved_step = self.step
        self.emit(CheckpointSaved(self.step, str(path),
                                  best=self.cfg.output.keep_best and best == self.step))
        return path

    def _best_step(self) -> int | None:
        """The step of the checkpoint output.keep_best keeps besides the newest (None: none)."""
        return self.best[0] if self.cfg.output.keep_best and self.best else None

    def _trainer_state(self) -> dict:
        """Everything but the tensors that a resume needs to continue exactly."""
        return {"step": self.step, "total_steps": self.total_steps,
                "next_lr": self.hyper(1.0).lr, "data": self.stream.state_dict(),
                "rng": rng_state(), "config": config_mod.to_dict(self.cfg),
                **self.depends, "best": self.best,
                "evals_without_gain": self.evals_without_gain}

    def _depends(self, own_data: bool) -> dict:
        """What a checkpoint records of the model, compute dtype and data it was trained from
        (slideformer.engine.train.resume); ``own_data``: the data is read from data.train."""
        from slideformer.engine.data.prepare import source_digests
        cfg = self.cfg
        sources = source_digests(cfg.data, self.run_dir.parent / ".token-cache") if own_data \
            else None
        return resume_rules.depends(cfg, device_kind(cfg.train.device, torch.cuda.is_available()),
                                    sources)

    def _accept(self, meta: dict) -> None:
        """Refuse a checkpoint that this run cannot continue (slideformer.engine.train.resume),
        or of another data position."""
        resume_rules.check(meta, self.cfg, self.depends)
        self.stream.load_state_dict(meta["data"])

    def _restore(self) -> None:
        """Load the newest checkpoint that verifies (a damaged one falls back to the previous)."""
        folder, meta = load_newest(self.run_dir / "checkpoints", state_tensors(self.host),
                                   self._accept,
                                   lambda text: self.emit(Log("warning", text)))
        self.step = self._saved_step = int(meta["step"])
        self.best = tuple(meta["best"]) if meta.get("best") else None
        self.evals_without_gain = int(meta.get("evals_without_gain", 0))
        self.executor.host_changed()
        set_rng_state(meta["rng"])
        # a kill during a rotation leaves one checkpoint too many, or a half-deleted one
        rotate(self.run_dir / "checkpoints", self.cfg.train.keep_checkpoints, self._best_step())
        changed = resume_rules.changes(meta["config"], config_mod.to_dict(self.cfg))
        if changed:
            self.emit(Log("warning", "resuming with changed settings: " + ", ".join(changed)))
        self.emit(Log("info", f"resumed from {folder.name}"))

    def _exported_at(self, step: int) -> bool:
        """Whether this folder's run finished at ``step`` with its final model written (a
        run whose export failed resumes to write it again)."""
        states = [e for e in read_events(self.run_dir / "events.jsonl") if isinstance(e, RunState)
                  and e.state in ("finished", "stopped", "failed")]
        return bool(states) and states[-1].state == "finished" and states[-1].step == step

    def cleanup(self) -> None:
        self.ranks.close()
        self.ranks = Solo()
        if self.executor is not None:
            self.executor.close()
            self.executor = None
            self.backend.release_host()
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self.trackers is not None:
            self.trackers.close()
            self.trackers = None
        if self.sink is not None:
            self.sink.close()
        self.lock.release()


def _write_atomic(path: Path, text: str) -> None:
    """Replace a small text file so that a reader sees the old or the new one, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
