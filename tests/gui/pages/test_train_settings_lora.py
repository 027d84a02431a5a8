"""The Train page's method selector and LoRA settings write the config the engine reads."""
from __future__ import annotations

from slideformer.engine import config as config_mod


def test_method_and_lora_settings_round_trip(qtbot, tmp_path):
    from slideformer.gui.pages.train.settings import RunSettings, write_config
    s = RunSettings()
    qtbot.addWidget(s)
    assert s.config().train.method == "full" and not s.rank.isEnabled()
    s.method.setCurrentIndex(s.method.findData("lora"))
    assert s.rank.isEnabled()
    s.rank.setValue(16)
    s.alpha.setValue(32.0)
    s.targets.setText("q_proj,v_proj")
    cfg = config_mod.load(write_config(s.config(), tmp_path / "run.toml"))
    assert cfg.train.method == "lora" and cfg.lora.rank == 16 and cfg.lora.alpha == 32.0
    assert cfg.lora.target_modules == "q_proj,v_proj"


def test_qlora_preset_sets_the_method(qtbot):
    from slideformer.gui.pages.train.settings import RunSettings
    s = RunSettings()
    qtbot.addWidget(s)
    preset = next(p for p in s.presets if p.values.get("train", {}).get("method") == "qlora")
    s.apply_preset(preset)
    cfg = s.config()
    assert cfg.train.method == "qlora" and cfg.lora.rank == 16
    assert s.method.currentData() == "qlora" and s.rank.value() == 16


def test_early_stopping_best_checkpoint_and_tensorboard_round_trip(qtbot, tmp_path):
    from dataclasses import replace

    from slideformer.gui.pages.train.settings import RunSettings, write_config
    s = RunSettings()
    qtbot.addWidget(s)
    base = s.config()
    s.show_config(replace(base, output=replace(base.output, report_to=("mlflow",))))
    s.eval_every.setValue(10)
    s.patience.setValue(3)
    s.keep_best.setChecked(True)
    s.tensorboard.setChecked(True)
    cfg = config_mod.load(write_config(s.config(), tmp_path / "run.toml"))
    assert cfg.train.early_stopping_patience == 3 and cfg.output.keep_best
    assert cfg.output.report_to == ("tensorboard", "mlflow")  # a tracker set in the file stays
    s.show_config(cfg)
    s.tensorboard.setChecked(False)
    assert s.config().output.report_to == ("mlflow",)
