"""Real chat templates (tests/fixtures/chat_templates): tool calls, reasoning, generation tags and
the known mask bugs, each mask checked token by token against transformers'
``return_assistant_tokens_mask`` (templates with generation tags) or against the reply texts
located in the rendering (the others)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from slideformer.engine.config import DataConfig
from slideformer.engine.data import preview
from slideformer.engine.data.chat import ChatRenderer
from slideformer.engine.data.encode import encode_chats
from slideformer.engine.data.tokenize import FormatTracker
from slideformer.engine.data.records import Record
from test_data_helpers import jsonl, tiny_dir, tokenizer_with, user_error  # noqa: F401

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
SPECIALS = {  # (special tokens the template writes, eos, bos)
    "qwen2.5": (("<|im_end|>",), None, None),
    "qwen3": (("<|im_end|>", "<think>", "</think>"), None, ""),
    "phi3.5": (("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
               "<|endoftext|>", ""),
    "mistral-v0.3": (("[INST]", "[/INST]", "</s>", "<s>", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                      "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "</s>", "<s>"),
    "generation-tags": ((), None, ""),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call12345", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "call12345", "content": '{"temp": 21}'},
             {"role": "assistant", "content": "It is 21 degrees in Paris."}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tpl(tiny_dir, tmp_path_factory):
    """tpl(name) -> a TokenizerInfo with that template and its special tokens."""
    made = {}

    def get(name):
        if name not in made:
            specials, eos, bos = SPECIALS[name]
            made[name] = tokenizer_with(tiny_dir, tmp_path_factory.mktemp(name),
                                        (TEMPLATES / f"{name}.jinja").read_text(), specials,
                                        eos=eos, bos=bos)
        return made[name]
    return get


def encode(tok, record: dict, **cfg):
    """(rendered text, token offsets, per-token trained flags) of one record."""
    config = DataConfig(**cfg)
    renderer = ChatRenderer(tok, config.chat_template, config.enable_thinking)
    doc = FormatTracker(config, renderer).document(Record(Path("r.jsonl"), 1, record))
    batch = encode_chats(tok, renderer, [doc], config.train_on, detail=True)
    return batch.texts[0], batch.offsets[0], [bool(x) for x in batch.mask], batch


def assert_trained(tok, record: dict, expected: list[str], **cfg) -> str:
    """The trained tokens are exactly those overlapping the ``expected`` strings (in order)."""
    text, offsets, mask, batch = encode(tok, record, **cfg)
    spans, cursor = [], 0
    for piece in expected:
        at = text.index(piece, cursor)
        spans.append((at, at + len(piece)))
        cursor = at + len(piece)
    want = [any(s < b and e > a for a, b in spans) for s, e in offsets]
    want[0] = False  # the first token is never a target
    assert len(mask) == len(want), "no EOS may be appended to these templates"
    bad = [(i, text[s:e]) for i, ((s, e), g, w) in enumerate(zip(offsets, mask, want)) if g != w]
    assert not bad, f"tokens trained differently from the expected replies: {bad[:5]}"
    return text


def test_qwen25_tool_calls_and_tools(tpl):
    tok = tpl("qwen2.5")
    text = assert_trained(tok, {"messages": TOOL_CHAT, "tools": [WEATHER]},
                          [CALL_TEXT + "<|im_end|>", "It is 21 degrees in Paris.<|im_end|>"])
    assert '"name": "get_weather", "description"' in text  # tools= reached the template
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text


def test_sharegpt_function_call_and_observation_match_openai_messages(tpl):
    tok = tpl("qwen2.5")
    sharegpt = {"conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": '
                                           '"Paris"}}'},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "It is 21 degrees in Paris."}],
        "tools": json.dumps([WEATHER["function"]])}  # LLaMA-Factory: a JSON string, unwrapped
    openai = {"messages": TOOL_CHAT, "tools": [WEATHER]}
    a, b = encode(tok, sharegpt), encode(tok, openai)
    assert a[0] == b[0] and a[2] == b[2]


def test_qwen3_tool_loop_and_reasoning_history(tpl):
    tok = tpl("qwen3")
    chat = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "Weather in Paris?"}] + TOOL_CHAT[1:]
    # the old reasoning is dropped by the template (history), the last turn gets an empty block
    assert_trained(tok, {"messages": chat, "tools": [WEATHER]},
                   ["4<|im_end|>", CALL_TEXT + "<|im_end|>",
                    "<think>\n\n</think>\n\nIt is 21 degrees in Paris.<|im_end|>"])


def test_qwen3_reasoning_kept_for_the_last_reply(tpl):
    tok = tpl("qwen3")
    chat = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add them"}]
    assert_trained(tok, {"messages": chat}, ["<think>\nadd them\n</think>\n\n4<|im_end|>"])


def test_qwen3_enable_thinking_off_makes_the_empty_block_prompt(tpl):
    tok = tpl("qwen3")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    on = assert_trained(tok, {"messages": chat}, ["<think>\n\n</think>\n\n4<|im_end|>"])
    off = assert_trained(tok, {"messages": chat}, ["4<|im_end|>"], enable_thinking=False)
    assert on == off  # the same text; only where the trained part starts differs


def test_phi35_multi_turn_trains_every_end_marker(tpl):
    """Was: the non-final replies' <|end|> untrained (the template ends with EOS only when the
    conversation ends, so the prefix rendering is not a prefix)."""
    tok = tpl("phi3.5")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+5?"}, {"role": "assistant", "content": "8"}]
    assert_trained(tok, {"messages": chat}, ["4<|end|>", "8<|end|>\n<|endoftext|>"])


def test_mistral_v03_system_prompt_keeps_the_reply_space_trained(tpl):
    """Was: with a system prompt the leading space of a reply was left untrained (the reply
    starts with an emoji, so the space is a token of its own in the test vocabulary)."""
    tok = tpl("mistral-v0.3")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Mood?"},
            {"role": "assistant", "content": "😀 fine"}, {"role": "user", "content": "Now?"},
            {"role": "assistant", "content": "😀 good"}]
    text, offsets, _, _ = encode(tok, {"messages": chat})
    space = text.index(" 😀 fine")
    assert any(s == space and e == space + 1 for s, e in offsets), "test needs a lone space"
    assert_trained(tok, {"messages": chat}, [" 😀 fine</s>", " 😀 good</s>"])


def test_mistral_v03_reply_space_is_trained_without_a_system_prompt(tpl):
    """The template writes "[/INST]" + " " + reply: the lone space is the reply's first token
    (what the model must predict after [/INST]), trained in every turn."""
    tok = tpl("mistral-v0.3")
    chat = [{"role": "user", "content": "Mood?"}, {"role": "assistant", "content": "😀 fine"},
            {"role": "user", "content": "Now?"}, {"role": "assistant", "content": "😀 good"}]
    text, offsets, _, _ = encode(tok, {"messages": chat})
    assert [(s, e) for s, e in offsets if text[s:e] == " " and text[s + 1:s + 2] == "😀"]
    assert_trained(tok, {"messages": chat}, [" 😀 fine</s>", " 😀 good</s>"])


def test_mistral_v03_dropped_system_prompt_is_warned(tpl, tmp_path):
    tok = tpl("mistral-v0.3")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Mood?"},
            {"role": "assistant", "content": "fine"}]
    path = jsonl(tmp_path / "a.jsonl", [{"messages": chat}])
    shown = preview(DataConfig(train=str(path)), tok)
    assert len(shown.warnings) == 1 and "leaves out the system prompt" in shown.warnings[0]
    assert "Be brief" not in "".join(p for p, _ in shown.samples[0].pieces)
    qwen = preview(DataConfig(train=str(path)), tpl("qwen2.5"))
    assert qwen.warnings == []


def test_mistral_v03_tool_calls(tpl):
    tok = tpl("mistral-v0.3")
    call = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, ' \
           '"id": "call12345"}]</s>'
    text = assert_trained(tok, {"messages": TOOL_CHAT, "tools": [WEATHER]},
                          [call, " It is 21 degrees in Paris.</s>"])
    assert text.count("[AVAILABLE_TOOLS]") == 1


@pytest.mark.parametrize("mask_history", [False, True])
def test_generation_tags_match_transformers(tpl, mask_history):
    transformers = pytest.importorskip("transformers")
    tok = tpl("generation-tags")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "3+5?"},
            {"role": "assistant", "content": "8, the sum."}]
    ref_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok.source /
                                                                      "tokenizer.json"))
    ref = ref_tok.apply_chat_template(chat, chat_template=tok.chat_template, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
    _, _, mask, batch = encode(tok, {"messages": chat}, mask_history=mask_history)
    assert batch.ids.tolist() == list(ref["input_ids"])
    want = [bool(x) for x in ref["assistant_masks"]]
    if mask_history:  # only the last reply: clear the first one's run
        first_end = want.index(False, want.index(True))
        want[:first_end] = [False] * first_end
    assert mask == want


def test_mask_history_trains_the_last_reply_only(tpl):
    tok = tpl("qwen2.5")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+5?"}, {"role": "assistant", "content": "8"}]
    assert_trained(tok, {"messages": chat}, ["8<|im_end|>"], mask_history=True)


def test_override_template_by_name_and_file(tpl, tmp_path):
    tok = tpl("phi3.5")
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "yo"}]}
    assert encode(tok, chat, chat_template="chatml")[0].startswith("<|im_start|>user\nhi")
    f = tmp_path / "t.jinja"
    f.write_text((TEMPLATES / "qwen2.5.jinja").read_text())
    assert "You are Qwen" in encode(tok, chat, chat_template=str(f))[0]
    err = user_error(encode, tok, chat, chat_template="nope")
    assert err.where == "data.chat_template" and "neither a file" in err.problem


def test_template_without_tool_support_refuses_tool_data(tpl):
    tok = tpl("phi3.5")
    err = user_error(encode, tok, {"messages": TOOL_CHAT})
    assert err.where == "r.jsonl:1" and "tool calls" in err.problem
    err = user_error(encode, tok, {"messages": TOOL_CHAT[:1] + TOOL_CHAT[3:], "tools": [WEATHER]})
    assert "tool schemas" in err.problem
