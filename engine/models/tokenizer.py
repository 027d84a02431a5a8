"""Tokenizer loading (``tokenizer.json`` via ``tokenizers``) and sandboxed chat templates.

A model folder is untrusted input: its ``chat_template`` is rendered in jinja2's
``ImmutableSandboxedEnvironment``, which refuses attribute tricks (``__class__``, ``__globals__``)
and unsafe calls, and caps ``range``; here it also caps ``*`` and ``**`` results, and recursion
and memory blow-ups are caught too. Every refusal becomes one :class:`UserError` naming the
template's file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engine.errors import UserError


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and its special tokens."""

    tok: Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    source: Path
    """The folder it came from (its tokenizer_config.json names the template's origin)."""

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_id(self) -> int | None:
        pad = self.token_id(self.pad_token)
        return self.eos_id if pad is None else pad

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """Render ``messages`` with the model's chat template (sandboxed)."""
        if self.chat_template is None:
            raise UserError(self.source / "tokenizer_config.json", "has no chat_template",
                            "use a model with a chat template, or plain-text data")
        return render_template(self.chat_template, self.source / "tokenizer_config.json",
                               messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_str(v) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _raise(msg):
    raise TemplateError(msg)


# Results larger than this from `*` (string/list repetition) or `**` (integer power) are refused:
# jinja2's sandbox caps `range` but not these, so "{{ 'a' * 10**10 }}" would exhaust memory and
# "{{ 9 ** (10**10) }}" would hang (jinja2 even folds it at compile time unless intercepted).
_MAX_ITEMS = 1_000_000
_MAX_INT_BITS = 1 << 16


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, plus size caps on the operators that can blow up."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                        and len(seq) * n > _MAX_ITEMS):
                    raise SecurityError(f"repetition to {len(seq) * n:,} items is too large")
        elif (isinstance(left, int) and isinstance(right, int) and right > 0
              and abs(left).bit_length() * right > _MAX_INT_BITS):
            bits = abs(left).bit_length() * right
            raise SecurityError(f"an integer power of about {bits:,} bits is too large")
        return super().call_binop(context, operator, left, right)


_ENV = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.globals.pop("lipsum", None)  # generates unbounded text on request; no chat template needs it
_ENV.globals.update(raise_exception=_raise,
                    strftime_now=lambda fmt: datetime.now().strftime(fmt))
_ENV.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)


def render_template(source: str, where: Path | str, **context) -> str:
    """Render a Jinja2 chat template in the sandbox; any refusal is a :class:`UserError`."""
    fix = "use the model's original tokenizer_config.json, or pick another model"
    try:
        return _ENV.from_string(source).render(**context)
    except SecurityError as e:
        raise UserError(where, f"chat_template was refused by the sandbox: {e}", fix) from None
    except OverflowError as e:
        raise UserError(where, f"chat_template was refused by the sandbox (too long a loop: {e})",
                        fix) from None
    except RecursionError:
        raise UserError(where, "chat_template was refused: unbounded recursion", fix) from None
    except MemoryError:
        raise UserError(where, "chat_template was refused: it ran out of memory", fix) from None
    except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError) as e:
        # a template is a program from the model folder: its own errors are the folder's fault
        detail = e if isinstance(e, TemplateError) else f"{type(e).__name__}: {e}"
        raise UserError(where, f"chat_template failed: {detail}", fix) from None


def load_tokenizer(model_dir: Path | str) -> TokenizerInfo:
    """Load ``tokenizer.json`` and the special tokens / chat template of a model folder."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise UserError(path, "is missing",
                        "copy tokenizer.json from the model's source into the model folder")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise UserError(path, f"cannot be read ({e})", "restore tokenizer.json from the model's source") from None
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(cfg_path, f"is not valid JSON ({e})",
                            "restore tokenizer_config.json from the model's source") from None
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return TokenizerInfo(tok=tok, bos_token=_token_str(cfg.get("bos_token")),
                         eos_token=_token_str(cfg.get("eos_token")),
                         pad_token=_token_str(cfg.get("pad_token")),
                         chat_template=template, source=model_dir)
