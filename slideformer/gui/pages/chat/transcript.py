"""A conversation as the Chat page shows it: turns, and their rendering as Qt rich text.

Qt-free: the page puts :func:`render_html` into a ``QTextBrowser``. Text is
escaped (a reply is model output, never markup).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

COLORS = {
    "light": {"user": "#e8f0fe", "assistant": "#f3f4f6", "role": "#6b7280", "note": "#9ca3af",
              "error": "#b91c1c", "text": "#111827"},
    "dark": {"user": "#1e3a5f", "assistant": "#232a36", "role": "#9ca3af", "note": "#6b7280",
             "error": "#f87171", "text": "#e5e7eb"},
}
ROLE_NAMES = {"user": "You", "assistant": "Model"}


@dataclass
class Turn:
    """One message of the conversation."""

    role: str
    """user, assistant, or notice (a line from the app, never sent to the model)."""
    text: str = ""
    note: str = ""
    """Shown small under the message: speed and how it ended, or what went wrong."""
    error: bool = False
    live: bool = field(default=False)
    """A reply still being generated (drawn with a cursor)."""


def messages_for_engine(turns: list[Turn]) -> list[dict]:
    """The conversation as chat-template messages (notices and failed replies left out)."""
    return [{"role": t.role, "content": t.text} for t in turns
            if t.role in ("user", "assistant") and not t.error and not t.live]


def reply_note(done: dict, mode: str) -> str:
    """"12 tokens · 23.4 tok/s · stopped" from a ``done`` event."""
    parts = [f"{done.get('new_tokens', 0)} tokens"]
    speed = done.get("tokens_per_s")
    if speed:
        parts.append(f"{speed:.1f} tok/s")
    if mode == "streamed":
        parts.append("streamed")
    reason = done.get("reason")
    if reason == "stopped":
        parts.append("stopped")
    elif reason == "length":
        parts.append("max tokens reached")
    return " · ".join(parts)


def _turn_html(t: Turn, c: dict) -> str:
    if t.role == "notice":
        return (f'<p align="center" style="color:{c["note"]}; font-size:small">'
                f'{html.escape(t.text)}</p>')
    body = html.escape(t.text).replace("\n", "<br>") + ("▌" if t.live else "")
    if not body:
        body = "&nbsp;"
    bg = c["user"] if t.role == "user" else c["assistant"]
    note = ""
    if t.note:
        colour = c["error"] if t.error else c["note"]
        note = f'<div style="color:{colour}; font-size:small">{html.escape(t.note)}</div>'
    return (f'<p style="margin-top:10px; margin-bottom:2px; color:{c["role"]}; font-size:small">'
            f'<b>{ROLE_NAMES.get(t.role, t.role)}</b></p>'
            f'<table width="100%" cellpadding="8" cellspacing="0" '
            f'style="background-color:{bg}"><tr><td style="color:{c["text"]}">{body}</td></tr>'
            f'</table>{note}')


def render_html(turns: list[Turn], theme: str = "light", empty: str = "") -> str:
    """The whole conversation as rich text; ``empty`` is shown when there is none."""
    c = COLORS.get(theme, COLORS["light"])
    if not turns:
        return f'<p style="color:{c["note"]}">{html.escape(empty)}</p>'
    return "".join(_turn_html(t, c) for t in turns)
