"""One config source: every group option composes and builds, and the code's defaults are the
command line's (the YAML files state only what differs from the dataclasses)."""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from speechattn import CONFIG_DIR
from speechattn.attention import available, build
from speechattn.attention.registry import options as attention_options
from speechattn.config import (
    AttentionGroupConfig,
    DownstreamConfig,
    PretrainConfig,
    PretrainModelConfig,
    compose,
)
from speechattn.data import DataConfig
from speechattn.model import ModelConfig
from speechattn.model.aalbert import aalbert, preset_config
from speechattn.tasks.analysis.sources import HeadsRunConfig
from speechattn.tasks.downstream import TaskConfig

ANALYZE = ["analysis=heads"]


def options(group: str) -> list[str]:
    names = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
    assert names, f"conf/{group}/ holds no options"
    return names


def own_keys(cfg, schema) -> dict:
    """The entry point's own keys (not its groups), unresolved."""
    groups = {"data", "attention", "model", "trainer", "logger", "task"}
    plain = OmegaConf.to_container(cfg, resolve=False)
    return {f.name: plain[f.name] for f in fields(schema) if f.name not in groups}


@pytest.mark.parametrize("name", options("data"))
def test_every_data_option_builds(name):
    cfg = compose("pretrain", [f"data={name}", "data.root=/corpus"])
    assert isinstance(OmegaConf.to_object(cfg.data), DataConfig)


@pytest.mark.parametrize("name", options("attention"))
def test_every_attention_option_builds_its_variant(name):
    cfg = compose("pretrain", [f"attention={name}"])
    assert cfg.attention.name == name in available()
    assert cfg.model.net.attention == name  # the model is wired to the chosen variant
    build(name, 32, 4, **OmegaConf.to_container(cfg.attention.options))


@pytest.mark.parametrize("experiment", [*options("experiment"), None])
@pytest.mark.parametrize("name", options("model"))
def test_every_model_option_and_experiment_builds(name, experiment):
    choice = f"experiment={experiment}" if experiment else "~experiment"
    cfg = compose("pretrain", [f"model={name}", choice, "data.root=/corpus"])
    model = OmegaConf.to_object(cfg.model)
    assert isinstance(model, PretrainModelConfig) and isinstance(model.net, ModelConfig)
    assert isinstance(OmegaConf.to_object(cfg.data), DataConfig)


@pytest.mark.parametrize("name", options("trainer"))
def test_every_trainer_option_names_trainer_arguments(name):
    cfg = OmegaConf.to_container(compose("pretrain", [f"trainer={name}"]).trainer, resolve=True)
    trainer = get_class(cfg.pop("_target_"))
    assert set(cfg) <= set(inspect.signature(trainer.__init__).parameters)


@pytest.mark.parametrize("name", options("logger"))
def test_every_logger_option_instantiates(name, tmp_path):
    cfg = compose("pretrain", [f"logger={name}", f"output_dir={tmp_path}"])
    for logger in cfg.logger.values():
        instantiate(logger)


@pytest.mark.parametrize("name", options("debug"))
def test_every_debug_option_composes(name):
    assert compose("pretrain", [f"debug={name}"]).trainer.max_steps > 0


DOWNSTREAM_TASKS = [t for t in options("task") if t != "pretrain"]  # pretrain: analysis only


def test_the_task_list_is_the_task_group():
    from speechattn.tasks.records import TASKS

    assert sorted(TASKS) == DOWNSTREAM_TASKS


@pytest.mark.parametrize("name", DOWNSTREAM_TASKS)
def test_every_task_option_builds_for_downstream_and_analysis(name):
    task = OmegaConf.to_object(compose("downstream", [f"task={name}"]).task)
    assert isinstance(task, TaskConfig) and task.name == name
    heads = OmegaConf.to_object(compose("analyze", [*ANALYZE, f"task={name}"]))
    assert isinstance(heads, HeadsRunConfig) and heads.task == name


def test_analysis_task_pretrain_and_data_options_build():
    heads = OmegaConf.to_object(compose("analyze", [*ANALYZE, "task=pretrain", "data=embedded"]))
    assert heads.task == "pretrain" and DataConfig(**heads.data) == DataConfig()


# ----------------------------------------------------------------------------- defaults


def test_code_defaults_are_the_command_lines():
    """Each group's default option is its dataclass's defaults, and each entry point's own
    keys default to its schema's."""
    pretrain = compose("pretrain", ["~experiment"])
    assert OmegaConf.to_object(pretrain.data) == DataConfig()
    model = OmegaConf.to_object(pretrain.model)
    assert model == PretrainModelConfig()  # attention=full: ModelConfig's own attention
    assert own_keys(pretrain, PretrainConfig) == own_keys(
        OmegaConf.structured(PretrainConfig), PretrainConfig
    )

    downstream = compose("downstream")
    assert OmegaConf.to_object(downstream.data) == DataConfig()
    assert OmegaConf.to_object(downstream.task) == TaskConfig()
    defaults = OmegaConf.merge(
        OmegaConf.structured(DownstreamConfig), {"task": TaskConfig(), "data": DataConfig()}
    )
    assert own_keys(downstream, DownstreamConfig) == own_keys(defaults, DownstreamConfig)
    assert downstream.trainer.max_epochs == TaskConfig().max_epochs

    assert OmegaConf.to_object(compose("analyze", ANALYZE)) == HeadsRunConfig()


def test_the_default_run_is_the_tiny_experiment_and_python_presets_match_it():
    cli = compose("pretrain").model
    assert cli.name == "aalbert_tiny"
    assert ModelConfig(**cli.net) == preset_config("aalbert_tiny")
    assert (
        ModelConfig(**compose("pretrain", ["~experiment"]).model.net)
        == preset_config("aalbert_base")
        == ModelConfig()
    )


def test_the_builder_keeps_model_config_defaults():
    """`aalbert(...)` spells out ModelConfig's fields as arguments: the same defaults."""
    params = inspect.signature(aalbert).parameters
    for f in fields(ModelConfig):
        default = f.default_factory() if callable(f.default_factory) else f.default
        assert params[f.name].default in (default, None), f.name  # options: None -> {}


def test_yaml_states_only_what_differs_from_the_schema():
    """No option restates a default of its schema (a mirror drifts)."""
    schemas = {"data": DataConfig(), "task": TaskConfig(), "model": PretrainModelConfig()}
    for group, defaults in schemas.items():
        for path in (CONFIG_DIR / group).glob("*.yaml"):
            own = OmegaConf.to_container(OmegaConf.load(path))
            restated = [k for k, v in own.items() if getattr(defaults, k, object()) == v]
            assert not restated, f"{path.name} restates defaults {restated}"
    for path in (CONFIG_DIR / "attention").glob("*.yaml"):  # extends the variant's schema
        own = OmegaConf.to_container(OmegaConf.load(path))
        assert own.pop("defaults") == [f"/schema/attention/{path.stem}@_here_", "_self_"]
        defaults = attention_options(path.stem)
        restated = [k for k, v in own.pop("options", {}).items() if defaults.get(k) == v]
        restated += [k for k, v in own.items() if getattr(AttentionGroupConfig, k, object()) == v]
        assert not restated, f"{path.name} restates defaults {restated}"


@pytest.mark.parametrize("name", options("analysis"))
def test_every_analysis_option_builds(name):
    heads = OmegaConf.to_object(compose("analyze", [f"analysis={name}"]))
    assert isinstance(heads, HeadsRunConfig) and heads.analysis == name


def test_task_pretrain_is_refused_by_the_downstream_job(tmp_path):
    from speechattn.tasks.downstream import run

    cfg = compose("downstream", ["task=pretrain", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="task=pretrain is the head analysis' objective"):
        run(cfg)
