"""CLI: ``slideformer chat`` -- talk to a model in the terminal, or serve the app (``--json``)."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the handler: building the parser imports no torch
    from slideformer.engine.generate.sampling import SamplingConfig

_SAMPLING_FLAGS = {"temperature": "temperature", "top_p": "top_p", "max_tokens": "max_new_tokens",
                   "seed": "seed"}
"""chat flag -> SamplingConfig field (a flag left out keeps the field's default)."""


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model folder or a run's checkpoint")
    p.add_argument("--model", required=True,
                   help="model folder, a LoRA run's adapter folder (a run's final/) or a run's "
                        "checkpoints/step-N")
    p.add_argument("--mode", choices=("auto", "resident", "streamed"), default="auto",
                   help="resident (all weights in memory, KV cache), streamed (layers read "
                        "through the window for every token: slow, for models larger than "
                        "memory), or auto (resident when it fits)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--slots", type=int, default=2, help="window slots when streamed")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: SamplingConfig's)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--max-tokens", type=int, help="longest reply, in tokens")
    p.add_argument("--seed", type=int)
    p.add_argument("--system", default=None, help="a system message for the conversation")
    p.add_argument("--json", action="store_true",
                   help="JSON-lines requests on stdin, events on stdout (what the app uses; "
                        "see slideformer/engine/generate/protocol.py)")
    p.set_defaults(func=_chat)


def _chat(a) -> int:
    from slideformer.engine.errors import UserError
    from slideformer.engine.generate.protocol import emit, serve
    from slideformer.engine.generate.sampling import SamplingConfig
    from slideformer.engine.generate.session import ChatModel
    try:
        model = ChatModel(a.model, mode=a.mode, device=a.device, slots=a.slots)
    except UserError as e:
        if not a.json:
            raise
        emit(sys.stdout, event="error", fatal=True, message=str(e))
        return 2
    try:
        if a.json:
            return serve(model)
        cfg = SamplingConfig(**{field: getattr(a, flag) for flag, field in _SAMPLING_FLAGS.items()
                                if getattr(a, flag) is not None})
        return repl(model, cfg, a.system)
    finally:
        model.close()


def repl(model, cfg: SamplingConfig, system: str | None) -> int:
    """Read a message, stream the reply, keep the conversation; Ctrl-C stops a reply."""
    from slideformer.engine.generate.decoder import Finished
    info = model.describe()
    print(f"{info['model']}: {info['family']}, {info['layers']} layers, {info['params']:,} "
          f"parameters, {info['mode']} on {info['device']} ({info['dtype']})")
    print("Type a message; /reset starts over, /quit (or Ctrl-D) ends. Ctrl-C stops a reply.")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        try:
            text = input("\nyou> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if text in ("/quit", "/exit"):
            return 0
        if text == "/reset":
            messages = list(start)
            print("(new conversation)")
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        print("model> ", end="", flush=True)
        reply, stop = [], []
        try:
            for out in model.reply(messages, cfg, should_stop=lambda: bool(stop)):
                if isinstance(out, Finished):
                    speed = f", {out.tokens_per_s:.1f} tok/s" if out.tokens_per_s else ""
                    print(f"\n[{out.new_tokens} tokens{speed}, {out.reason}]")
                else:
                    reply.append(out.text)
                    print(out.text, end="", flush=True)
        except KeyboardInterrupt:
            print("\n[stopped]")
        messages.append({"role": "assistant", "content": "".join(reply)})
