"""Tokenizer loading (``tokenizer.json`` via ``tokenizers``) and sandboxed chat templates.

A model folder is untrusted input: its ``chat_template`` is rendered in jinja2's
``ImmutableSandboxedEnvironment``, which refuses attribute tricks (``__class__``, ``__globals__``)
and unsafe calls, and caps ``range``. Here each render also runs under a budget
(:class:`RenderBudget`): loop iterations, output characters and seconds; and the operators,
methods and filters whose result can be far larger than their inputs (``*``, ``**``, ``+``, ``~``,
``%``, ``format``, ``center``, ``replace``, ...) are refused past a size cap before they allocate.
Every refusal becomes one :class:`UserError` naming the template's file.
"""
from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer
from tokenizers import Tokenizer

from slideformer.engine.errors import UserError
from slideformer.engine.jsonfile import read_json, surrogate_key


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and its special tokens."""

    tok: Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    source: Path
    """The folder it came from."""
    template_file: Path | None = None
    """The file the chat template was read from (tokenizer_config.json or chat_template.jinja);
    None: the folder's tokenizer_config.json."""

    @property
    def template_where(self) -> Path:
        """The file a message about the chat template names."""
        return self.template_file or self.source / "tokenizer_config.json"

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

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False,
                    **variables) -> str:
        """Render ``messages`` with the model's chat template (sandboxed); ``variables`` are
        more names the template reads (``enable_thinking=False``) or replace the special
        tokens (``bos_token=""``)."""
        if self.chat_template is None:
            raise UserError(self.source / "tokenizer_config.json", "has no chat_template",
                            "use a model with a chat template, or plain-text data")
        tokens = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        return render_template(self.chat_template, self.template_where, **(tokens | variables),
                               messages=messages, add_generation_prompt=add_generation_prompt)


def _token_str(v) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _raise(msg):
    raise TemplateError(msg)


# Results larger than this from an operator, method or filter are refused (jinja2's sandbox caps
# `range` but not these: "{{ 'a' * 10**10 }}" would exhaust memory, "{{ 9 ** (10**10) }}" would
# hang, and jinja2 even folds such constants at compile time unless intercepted).
_MAX_ITEMS = 1_000_000
_MAX_INT_BITS = 1 << 16
# Per render. A real chat template renders one conversation in well under a millisecond with a
# few hundred loop iterations; these leave a 1000x margin and stop a hostile one in ~1 s.
MAX_ITERATIONS = 1_000_000
MAX_OUTPUT = 16 * _MAX_ITEMS
"""Characters a render may produce."""
MAX_SECONDS = 5.0
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
_BRACE_SPEC = re.compile(r"\{[^{}]*:([^{}]*)\}")


class RenderBudget:
    """What one render may still spend: loop iterations, output characters, wall time."""

    def __init__(self):
        self.iterations = MAX_ITERATIONS
        self.output = MAX_OUTPUT
        self.deadline = time.monotonic() + MAX_SECONDS

    def tick(self) -> None:
        self.iterations -= 1
        if self.iterations < 0:
            raise SecurityError(f"more than {MAX_ITERATIONS:,} loop iterations (render budget)")
        if time.monotonic() > self.deadline:
            raise SecurityError(f"rendering took more than {MAX_SECONDS:g} s (render budget)")

    def iterate(self, iterable):
        """``iterable``, one tick per item (every ``{% for %}`` of a template runs through it)."""
        for item in iterable:
            self.tick()
            yield item

    def concat(self, *parts) -> str:
        """The ``~`` operator, refused past the size cap."""
        parts = [str(p) for p in parts]
        _cap(sum(map(len, parts)), "a ~ concatenation")
        return "".join(parts)

    def emit(self, chunk: str) -> str:
        self.output -= len(chunk)
        if self.output < 0:
            raise SecurityError(f"the output is longer than {MAX_OUTPUT:,} characters "
                                "(render budget)")
        return chunk


def _cap(n: int, what: str) -> None:
    if n > _MAX_ITEMS:
        raise SecurityError(f"{what} of {n:,} items is too large")


def _check_format(fmt: str, args) -> None:
    """Refuse a ``%`` or ``format`` whose field widths would build a huge string."""
    widths = [w for m in _PERCENT_SPEC.finditer(fmt) for w in m.groups() if w]
    widths += [w for m in _BRACE_SPEC.finditer(fmt) for w in re.findall(r"\d+", m.group(1))]
    values = args if isinstance(args, (tuple, list)) else (args,)
    if ":{" in fmt:  # a nested width, "{:{w}}", comes from the arguments
        widths.append("*")
    for width in widths:
        if width == "*":
            width = max((abs(a) for a in values if isinstance(a, int)), default=0)
        _cap(int(width), "a formatting width")


def _check_call(obj, args, kwargs) -> None:
    """Size caps on the str methods whose result can outgrow their inputs."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int):
                _cap(a * max(1, owner.count("\t")) if name == "expandtabs" else a, f"str.{name}")
    elif name == "replace" and len(args) >= 2:
        _check_replace(owner, *args[:2])


def _check_replace(s, old, new) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        count = s.count(old) if old else len(s) + 1
        _cap(len(s) + count * max(0, len(new) - len(old)), "a replace")


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, plus size caps on everything that can blow up."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _cap(len(seq) * n, "a repetition")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and hasattr(right, "__len__"):
            _cap(len(left) + len(right), "a + concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0
              and abs(left).bit_length() * right > _MAX_INT_BITS):
            bits = abs(left).bit_length() * right
            raise SecurityError(f"an integer power of about {bits:,} bits is too large")
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):
        inner = super().wrap_str_format(value)  # jinja2 swaps str.format for its own at access
        if inner is None:
            return None

        def checked(*args, **kwargs):
            _check_format(value.__self__, (*args, *kwargs.values()))
            return inner(*args, **kwargs)
        return checked

    def call(self, __context, __obj, *args, **kwargs):
        budget = __context.get("__budget")
        if isinstance(budget, RenderBudget):  # a recursive loop() or a macro runs no {% for %}
            budget.tick()
        _check_call(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _capped_filter(inner, check):
    """A built-in filter with a size check of its arguments first."""
    def wrapped(value, *args, **kwargs):
        check(value, *args, **kwargs)
        return inner(value, *args, **kwargs)
    return wrapped


def _width_arg(value, width=80, *args, **kwargs) -> None:
    if isinstance(width, int):
        _cap(width * (str(value).count("\n") + 1), "a filter width")


class _Budgeted(NodeTransformer):
    """Rewrites a parsed template so every loop and ``~`` goes through the render's budget."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = _budget_call("iterate", [node.iter], node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return _budget_call("concat", node.nodes, node.lineno)


def _budget_call(method: str, args, lineno: int):
    target = nodes.Getattr(nodes.Name("__budget", "load"), method, "load")
    return nodes.Call(target, list(args), [], None, None).set_lineno(lineno)


_ENV = _ChatSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.globals.pop("lipsum", None)  # generates unbounded text on request; no chat template needs it
_ENV.globals.update(raise_exception=_raise,
                    strftime_now=lambda fmt: datetime.now().strftime(fmt))
_ENV.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
for _name, _check in (("center", _width_arg), ("indent", _width_arg),
                      ("batch", lambda v, n, *a, **k: _cap(n if isinstance(n, int) else 0, "a batch")),
                      ("slice", lambda v, n, *a, **k: _cap(n if isinstance(n, int) else 0, "a slice")),
                      ("replace", lambda v, old, new, *a, **k: _check_replace(str(v), old, new)),
                      ("format", lambda v, *a, **k: _check_format(str(v), a or tuple(k.values()))),
                      ("tojson", lambda v, indent=None: _cap(indent if isinstance(indent, int) else 0,
                                                             "a tojson indent"))):
    _ENV.filters[_name] = _capped_filter(_ENV.filters[_name], _check)


_TEMPLATE_FIX = "use the model's original tokenizer_config.json, or pick another model"


def compile_template(source: str, where: Path | str, env=None):
    """A chat template compiled with every loop and ``~`` budgeted (see :class:`RenderBudget`).

    ``env``: an overlay of this module's sandbox with more extensions (slideformer.engine.data's
    ``{% generation %}`` tag); None: the sandbox itself.
    """
    try:
        return _compile(source, env or _ENV)
    except TemplateError as e:
        raise UserError(where, f"chat_template failed: {e}", _TEMPLATE_FIX) from None
    except RecursionError:
        raise UserError(where, "chat_template is nested too deeply to compile",
                        _TEMPLATE_FIX) from None


@functools.lru_cache(maxsize=16)
def _compile(source: str, env):
    # compiling costs ~1 ms, rendering ~10 us: slideformer.engine.data renders each conversation many times
    return env.from_string(_Budgeted().visit(env.parse(source)))


def render_template(source: str, where: Path | str, env=None, **context) -> str:
    """Render a Jinja2 chat template in the sandbox (``env``: see :func:`compile_template`),
    under a fresh :class:`RenderBudget`; any refusal is a :class:`UserError`."""
    template = compile_template(source, where, env)
    budget = RenderBudget()
    fix = _TEMPLATE_FIX
    try:
        return "".join(budget.emit(chunk) for chunk in template.generate(**context, __budget=budget))
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
    cfg = read_json(cfg_path, _CONFIG_FIX) if cfg_path.is_file() else {}
    if not isinstance(cfg, dict):
        raise UserError(cfg_path, f"is a JSON {type(cfg).__name__}, not an object", _CONFIG_FIX)
    if (key := surrogate_key(cfg)) is not None:
        raise UserError(cfg_path, f"'{key}' holds text that is not valid Unicode (a lone "
                        "surrogate escape)", _CONFIG_FIX)
    template, template_file = _chat_template(cfg, cfg_path, model_dir / "chat_template.jinja")
    info = TokenizerInfo(tok=tok, bos_token=_token_str(cfg.get("bos_token")),
                         eos_token=_token_str(cfg.get("eos_token")),
                         pad_token=_token_str(cfg.get("pad_token")),
                         chat_template=template, source=model_dir, template_file=template_file)
    _check_special_tokens(info, path)
    return info


def _check_special_tokens(info: TokenizerInfo, path: Path) -> None:
    """A special token of tokenizer_config.json that tokenizer.json has must encode as its one
    id: templates write it as text, and split into pieces it is never learned (a model that
    never emits its end-of-sequence id does not stop)."""
    for role in ("bos_token", "eos_token", "pad_token"):
        token = getattr(info, role)
        tid = info.token_id(token)
        if tid is not None and info.encode(token) != [tid]:
            raise UserError(path, f"does not encode the {role} {token!r} of "
                            "tokenizer_config.json as one token (it is not among its added "
                            "tokens)", "use the tokenizer.json that came with "
                            "tokenizer_config.json")


_CONFIG_FIX = "restore tokenizer_config.json from the model's source"


def _chat_template(cfg: dict, cfg_path: Path, jinja_file: Path) -> tuple[str | None, Path | None]:
    """(template, its file): tokenizer_config.json's (a string, or the ``default`` of a named
    list), else chat_template.jinja's, else (None, None)."""
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]: take the default one
        named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
        if len(named) != len(template):
            raise UserError(cfg_path, "chat_template is a list whose entries are not all "
                            '{"name": ..., "template": "..."}', _CONFIG_FIX)
        template = next((t["template"] for t in named if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise UserError(cfg_path, f"chat_template is a JSON {type(template).__name__}, not a "
                        "string", _CONFIG_FIX)
    if template is not None:
        return template, cfg_path
    if not jinja_file.is_file():
        return None, None
    try:
        return jinja_file.read_text(encoding="utf-8"), jinja_file
    except UnicodeDecodeError as e:
        raise UserError(jinja_file, f"is not valid UTF-8 ({e.reason} at byte {e.start})",
                        "restore chat_template.jinja from the model's source") from None


def check_vocab(tok: TokenizerInfo, vocab_size: int, config: Path | str) -> None:
    """Refuse a tokenizer that can produce ids the model's embedding has no row for."""
    top = max(tok.tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise UserError(tok.source / "tokenizer.json", f"has token ids up to {top:,} but "
                        f"{config} says vocab_size = {vocab_size:,}",
                        "use the tokenizer that came with the model's weights")
