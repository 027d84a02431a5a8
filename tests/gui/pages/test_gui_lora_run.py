"""A LoRA run from the GUI, as a user makes it: the tiny Llama chosen on the Model page, the demo
task, method "LoRA" on the Train page and its Start button (the real engine process). The
adapter folder the run exports loads with ``peft.PeftModel.from_pretrained`` onto the Hugging
Face base; its logits equal those of the merged model the engine wrote beside it, and differ
from the base's (the adapters learned)."""
import json

import pytest
import torch
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QScrollArea

from slideformer.engine.api import write_task
from test_gui_training import _never_ask, fill_settings  # noqa: F401

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

RANK, ALPHA = 4, 8.0


def test_a_lora_run_started_from_the_train_page_exports_an_adapter_peft_loads(
        qtbot, window, tiny_llama, tmp_path):
    with qtbot.waitSignal(window.model_page.model_selected, timeout=20000):
        window.model_page.load(str(tiny_llama))
    window.show_page("Data")
    data = window.pages["Data"]
    write_task(tmp_path / "reverse.jsonl", 64, seed=1)  # the demo task, a few records
    with qtbot.waitSignal(data.analysed, timeout=30000):
        data.set_file(str(tmp_path / "reverse.jsonl"))
    window.show_page("Train")
    page = window.pages["Train"]
    s = page.settings
    fill_settings(page, max_steps=4, micro_batch=2, grad_accum=1, seq_len=64, lr=2e-2,
                  save_every=0, eval_every=0)
    s.method.setCurrentIndex(s.method.findData("lora"))
    s.rank.setValue(RANK)
    s.alpha.setValue(ALPHA)
    s.targets.setText("q_proj,v_proj,down_proj")
    scroll = s.parentWidget()
    while not isinstance(scroll, QScrollArea):  # the settings column scrolls: as a user would
        scroll = scroll.parentWidget()
    scroll.ensureWidgetVisible(s.merged)
    # on its box: a click in the middle of a wide check box can miss its label
    qtbot.mouseClick(s.merged, Qt.MouseButton.LeftButton, pos=QPoint(8, s.merged.height() // 2))
    assert s.merged.isChecked()

    qtbot.mouseClick(page.start_button, Qt.MouseButton.LeftButton)
    run_dir = page.run_dir
    qtbot.waitUntil(lambda: page.end is not None, timeout=300000)
    assert page.end.outcome == "finished", page.end
    final = run_dir / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (RANK, ALPHA)
    assert adapter["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    assert page.dashboard.status.text().startswith("Finished.")

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (2, 19),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, final)(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(
            run_dir / "final-merged", dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(adapted, plain, rtol=0, atol=1e-3)  # the adapters trained
