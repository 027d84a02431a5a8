"""The Trainer: ``setup / train / save_checkpoint / cleanup``, driven by a RunConfig.

Front ends call :meth:`Trainer.pause`, :meth:`Trainer.resume` and :meth:`Trainer.stop` from
another thread; they take effect between steps. Everything the run reports goes through events
(``engine.events``) to the callbacks and to ``<run dir>/events.jsonl``.
"""
from __future__ import annotations

import json
import math
import os
import resource
import shutil
import threading
import time
from pathlib import Path

import torch

from engine import config as config_mod
from engine.config import RunConfig, parse_bytes
from engine.errors import UserError
from engine.events import CheckpointSaved, EvalMetrics, EventSink, Log, RunState, StepMetrics, Timeline
from engine.models.spec import load_spec
from engine.models.tokenizer import load_tokenizer
from engine.runtime.backend import make_backend
from engine.runtime.executor import ExecShape, SlidingExecutor
from engine.runtime.host_state import AdamHyper
from engine.train.schedule import lr_at
from engine.train.state import DTYPES, build_host_state, export_model, load_state, load_weights, save_state


def peak_rss() -> int:
    """Peak resident memory of this process in bytes."""
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
        self.executor = None
        self.sink = None

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
        """Load the model, data and state; ``data`` (prepared, stream) overrides engine.data."""
        cfg = self.cfg
        self._check_run_dir(resume)
        self.sink = EventSink(self.run_dir / "events.jsonl", self.callbacks)
        self.emit(RunState("setup", "loading model and data"))
        (self.run_dir / "config.toml").write_text(config_mod.dumps(cfg))
        self.spec = load_spec(cfg.model.path)
        self.tok = load_tokenizer(cfg.model.path)
        self.backend = make_backend(cfg.train.device)
        self.dtype = self._compute_dtype()
        self.prepared, self.stream = data if data is not None else self._prepare_data()
        self.total_steps = cfg.train.max_steps or max(1, math.ceil(
            cfg.train.epochs * self.stream.steps_per_epoch))
        moments = DTYPES.get(cfg.optim.moments_dtype)
        if moments not in (torch.float32, torch.bfloat16):
            raise UserError("optim.moments_dtype", f"{cfg.optim.moments_dtype!r} is not supported",
                            "use \"float32\" (exact) or \"bfloat16\"")
        self.host = build_host_state(self.spec, self.backend, self.dtype, moments)
        load_weights(self.host, self.spec, cfg.model.path, self.emit)
        self.executor = SlidingExecutor(self.spec, self.backend, self.host, self.exec_shape(), self.dtype)
        if resume:
            self._restore(self._latest_checkpoint())
        self.emit(Log("info", f"{self.spec.model_type}: {self.spec.num_params:,} parameters, "
                              f"{self.spec.num_layers} layers, {self.executor.k} slots, "
                              f"{self.dtype}, {self.total_steps} steps"))

    def exec_shape(self) -> ExecShape:
        """The executor shape the planner picks (slots, checkpoint placement, LM-head chunk).

        The plan's memory model and the executor share this shape, so prediction and run cannot
        drift apart; budget.slots and budget.checkpoints, when set, override the plan's choice.
        """
        from engine.plan import plan_run
        self.plan = plan_run(self.cfg, self.spec, device="cuda" if self.backend.is_cuda else "cpu")
        if self.plan.verdict == "does not fit":
            fix = f"; try: {self.plan.fixes[0].change}" if self.plan.fixes else ""
            self.emit(Log("warning", f"the planner predicts this run does not fit: "
                                     f"{self.plan.reason}{fix}"))
        return self.plan.exec_shape

    def _compute_dtype(self) -> torch.dtype:
        name = self.cfg.train.compute_dtype
        if name == "auto":
            return torch.bfloat16 if self.backend.is_cuda else torch.float32
        if name not in ("float32", "bfloat16"):
            raise UserError("train.compute_dtype", f"{name!r} is not supported",
                            "use auto, bfloat16 or float32")
        return DTYPES[name]

    def _check_run_dir(self, resume: bool) -> None:
        used = self.run_dir.is_dir() and any(self.run_dir.iterdir())
        if used and not resume:
            raise UserError(self.run_dir, "already holds a run",
                            "resume it (--resume) or choose another output.run_dir")
        if resume and not (self.run_dir / "checkpoints").is_dir():
            raise UserError(self.run_dir, "has no checkpoints to resume from",
                            "start a new run without --resume")
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _prepare_data(self):
        from engine.data import BatchStream, prepare_data
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
            skipped_in_row = skipped_in_row + 1 if out.skipped else 0
            if skipped_in_row >= 3:
                self.emit(Log("error", "3 steps in a row had non-finite loss or gradients"))
                self._stop_save, _ = True, self._stop.set()
            every = cfg.train.save_every
            if every and self.step % every == 0 and self.step < self.total_steps:
                self.save_checkpoint()
            if cfg.train.eval_every and self.step % cfg.train.eval_every == 0:
                self.evaluate()
        return self._finish()

    def _one_step(self):
        self.backend.reset_peak()
        t0 = time.perf_counter()
        mbs = self.stream.next_step()
        out = self.executor.train_step(mbs, self.hyper, self.cfg.optim.max_grad_norm)
        dt = time.perf_counter() - t0
        if not out.skipped:
            self.step += 1
        seen = sum(mb.input_ids.numel() for mb in mbs)
        self.emit(StepMetrics(step=self.step, total_steps=self.total_steps,
                              loss=None if out.skipped else out.loss, lr=self.hyper(1.0).lr,
                              grad_norm=out.grad_norm if math.isfinite(out.grad_norm) else None,
                              tokens=out.tokens, tokens_per_s=seen / dt, step_time=dt,
                              peak_vram=self.backend.peak_memory(), peak_ram=peak_rss(),
                              skipped=out.skipped))
        if out.skipped:
            self.emit(Log("warning", "non-finite loss or gradients: step skipped"))
        if self._last_timeline is not None:
            self.emit(Timeline(self._last_timeline[0], self._last_timeline[1].resolve()))
        self._last_timeline = (self.step, out.timeline)
        return out

    _last_timeline = None

    def evaluate(self) -> float | None:
        """Mean validation loss over the validation split (None without one)."""
        if getattr(self.prepared, "val", None) is None:
            return None
        from engine.data import iterate_eval
        total = count = 0.0
        for mb in iterate_eval(self.prepared.val, self.cfg.train.micro_batch):
            loss_sum, n = self.executor.eval_loss(mb)
            total, count = total + loss_sum, count + n
        if not count:
            return None
        val = total / count
        self.emit(EvalMetrics(self.step, val))
        return val

    def _finish(self) -> str:
        self.executor.drain()
        if self._last_timeline is not None:
            self.emit(Timeline(self._last_timeline[0], self._last_timeline[1].resolve()))
            self._last_timeline = None
        if self._stop.is_set() and not self._stop_save:
            self.emit(RunState("stopped", "stopped without saving", self.step))
            return "stopped"
        self.evaluate()
        if self.step < self.total_steps:
            self.save_checkpoint()
        self.emit(RunState("saving", "exporting the final model", self.step))
        out = self.export(self.run_dir / "final")
        state = "stopped" if self.step < self.total_steps else "finished"
        self.emit(RunState(state, f"model saved to {out}", self.step))
        return state

    def export(self, out_dir: Path) -> Path:
        self.executor.drain()
        dtype = DTYPES.get(self.spec.torch_dtype, torch.bfloat16)
        return export_model(self.host, self.spec, out_dir, self.cfg.model.path, dtype,
                            parse_bytes(self.cfg.output.shard_size, "output.shard_size"))

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write checkpoints/step-N atomically (temp folder, fsync, rename); keep the last N."""
        self.executor.drain()
        root = self.run_dir / "checkpoints"
        final, tmp = root / f"step-{self.step}", root / f".step-{self.step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_state(self.host, tmp)
        meta = {"step": self.step, "total_steps": self.total_steps,
                "data": self.stream.state_dict(), "torch_rng": torch.get_rng_state().tolist()}
        (tmp / "trainer.json").write_text(json.dumps(meta))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        done = sorted((p for p in root.glob("step-*") if p.is_dir()), key=lambda p: int(p.name[5:]))
        for old in done[:-max(1, self.cfg.train.keep_checkpoints)]:
            shutil.rmtree(old, ignore_errors=True)
        self.emit(CheckpointSaved(self.step, str(final)))
        return final

    def _latest_checkpoint(self) -> Path:
        done = sorted((p for p in (self.run_dir / "checkpoints").glob("step-*")
                       if (p / "trainer.json").is_file()), key=lambda p: int(p.name[5:]))
        if not done:
            raise UserError(self.run_dir / "checkpoints", "holds no complete checkpoint",
                            "start a new run without --resume")
        return done[-1]

    def _restore(self, folder: Path) -> None:
        meta = json.loads((folder / "trainer.json").read_text())
        load_state(self.host, folder)
        self.step = int(meta["step"])
        self.stream.load_state_dict(meta["data"])
        torch.set_rng_state(torch.tensor(meta["torch_rng"], dtype=torch.uint8))
        self.emit(Log("info", f"resumed from {folder.name}"))

    def cleanup(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None
            self.backend.release_host()
        if self.sink is not None:
            self.sink.close()
