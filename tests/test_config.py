"""One config source: every group option composes and builds, and the code's defaults are the
command line's (the YAML files state only what differs from the dataclasses)."""

from __future__ import annotations

import inspect
from dataclasses import fields, is_dataclass

import pytest
from hydra.utils import get_class
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
from speechattn.tasks.abx import AbxConfig
from speechattn.tasks.analysis.prune import PruneConfig
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
    required = {"lhotse": ["data.cuts=/corpus/cuts.jsonl.gz"]}.get(name, ["data.root=/corpus"])
    cfg = compose("pretrain", [f"data={name}", *required])
    data = OmegaConf.to_object(cfg.data)
    assert isinstance(data, DataConfig) and data.root == "/corpus" and data.pretrain_splits


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


JOB_OF_TRAINER = {"probe": "downstream"}  # the others are pretraining's


@pytest.mark.parametrize("name", options("trainer"))
def test_every_trainer_option_names_trainer_arguments(name):
    job = JOB_OF_TRAINER.get(name, "pretrain")
    cfg = OmegaConf.to_container(compose(job, [f"trainer={name}"]).trainer, resolve=True)
    trainer = get_class(cfg.pop("_target_"))
    assert set(cfg) <= set(inspect.signature(trainer.__init__).parameters)


@pytest.mark.parametrize("job", ["pretrain", "downstream"])
@pytest.mark.parametrize("name", options("logger"))
def test_every_logger_option_instantiates(name, job, tmp_path):
    from speechattn.tasks.common import configured_loggers

    cfg = compose(job, [f"logger={name}", f"output_dir={tmp_path}"])
    for logger in cfg.logger.values():
        cls = get_class(logger._target_)
        assert set(logger) - {"_target_"} <= set(inspect.signature(cls.__init__).parameters)
    if name in ("wandb", "mlflow"):  # optional extras: speechattn[wandb], speechattn[mlflow]
        pytest.importorskip(name)
    assert len(configured_loggers(cfg)) == len(cfg.logger)


@pytest.mark.parametrize("name", options("debug"))
def test_every_debug_option_composes(name):
    assert compose("pretrain", [f"debug={name}"]).trainer.max_steps > 0


DOWNSTREAM_TASKS = [t for t in options("task") if t != "pretrain"]  # pretrain: analysis only


EXAMPLE_TASKS = ["pitch_utterance"]  # docs/extending.md's worked example, not a study task


def test_the_task_list_is_the_task_group():
    from speechattn.tasks.records import TASKS

    assert sorted([*TASKS, *EXAMPLE_TASKS]) == DOWNSTREAM_TASKS


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

    abx = compose("abx")
    assert OmegaConf.to_object(abx.data) == DataConfig()
    assert own_keys(abx, AbxConfig) == own_keys(OmegaConf.structured(AbxConfig), AbxConfig)


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
    """`aalbert(...)` builds `ModelConfig(...)`: its defaults are ModelConfig's, stated once."""
    assert set(inspect.signature(aalbert).parameters) == {"make_attention", "config"}
    assert aalbert().config == ModelConfig()
    assert aalbert(dim=64, num_heads=4).config == ModelConfig(dim=64, num_heads=4)


NOT_VALUES = {"defaults", "hydra", "_target_"}  # composition keys, not settings


def restated(own: dict, defaults, path: str = "") -> list[str]:
    """Dotted keys of `own` (a YAML file's mapping) whose value equals the default they
    override; `defaults` is a dataclass instance or a dict, nested ones followed."""
    found = []
    for key, value in own.items():
        if key in NOT_VALUES:
            continue
        if isinstance(defaults, dict):
            default = defaults.get(key, NOT_VALUES)
        else:
            default = getattr(defaults, key, NOT_VALUES)
        if isinstance(value, dict) and (isinstance(default, dict) or is_dataclass(default)):
            found += restated(value, default, f"{path}{key}.")
        elif value == default:
            found.append(f"{path}{key}")
    return found


def yaml(path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path))


def signature_defaults(target: str) -> dict:
    params = inspect.signature(get_class(target).__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def test_yaml_states_only_what_differs_from_the_schema():
    """No YAML file restates a default of what it configures (a mirror drifts):

    - the groups with a dataclass schema (data, task, model, nested fields included) and the
      entry points' own files (pretrain, downstream, analyze, prune) against their schema;
    - the options that write at the top level (experiment, debug, analysis, trainer=gpu)
      against the schemas of the keys they set, and trainer=cpu's values for `trainer`;
    - the trainer options that extend another (ddp extends cpu) against that option;
    - each logger against its class's own arguments;
    - each attention option against its variant's generated schema (`/schema/attention/NAME`).

    The base trainer options (cpu, probe) are the one home of our Trainer settings; they keep
    keys equal to Lightning's defaults so that the command line can override them without `+`.
    `hydra/launcher/` configures Hydra's plugins.
    """
    cpu = yaml(CONFIG_DIR / "trainer" / "cpu.yaml")
    top_level = {  # what experiment/debug options and trainer=gpu write into: pretraining's
        **{f.name: getattr(PretrainConfig(), f.name) for f in fields(PretrainConfig)},
        "data": DataConfig(),
        "model": PretrainModelConfig(),
        "trainer": cpu,
    }
    schemas = {
        "data": DataConfig(),
        "task": TaskConfig(),
        "model": PretrainModelConfig(),
        "experiment": top_level,
        "debug": top_level,
        "analysis": HeadsRunConfig(),
    }
    checked = {}
    for group, defaults in schemas.items():
        for path in (CONFIG_DIR / group).glob("*.yaml"):
            checked[f"{group}/{path.name}"] = restated(yaml(path), defaults)
    for name, schema in (
        ("pretrain", PretrainConfig()),
        ("downstream", DownstreamConfig()),
        ("analyze", HeadsRunConfig()),
        ("prune", PruneConfig()),
        ("abx", AbxConfig()),
    ):
        checked[f"{name}.yaml"] = restated(yaml(CONFIG_DIR / f"{name}.yaml"), schema)
    checked["trainer/ddp.yaml"] = restated(yaml(CONFIG_DIR / "trainer" / "ddp.yaml"), cpu)
    checked["trainer/gpu.yaml"] = restated(yaml(CONFIG_DIR / "trainer" / "gpu.yaml"), top_level)
    for path in (CONFIG_DIR / "logger").glob("*.yaml"):
        for logger in yaml(path).values():
            own = restated(logger, signature_defaults(logger["_target_"]))
            checked[f"logger/{path.name}"] = checked.get(f"logger/{path.name}", []) + own
    for path in (CONFIG_DIR / "attention").glob("*.yaml"):  # extends the variant's schema
        own = yaml(path)
        assert own.pop("defaults") == [f"/schema/attention/{path.stem}@_here_", "_self_"]
        defaults = attention_options(path.stem)
        found = [f"options.{k}" for k, v in own.pop("options", {}).items() if defaults.get(k) == v]
        found += [k for k, v in own.items() if getattr(AttentionGroupConfig, k, object()) == v]
        checked[f"attention/{path.name}"] = found
    assert len(checked) > 40
    assert {k: v for k, v in checked.items() if v} == {}


@pytest.mark.parametrize("name", options("analysis"))
def test_every_analysis_option_builds(name):
    heads = OmegaConf.to_object(compose("analyze", [f"analysis={name}"]))
    assert isinstance(heads, HeadsRunConfig) and heads.analysis == name


def test_task_pretrain_is_refused_by_the_downstream_job(tmp_path):
    from speechattn.tasks.downstream import run

    cfg = compose("downstream", ["task=pretrain", f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="task=pretrain is the head analysis' objective"):
        run(cfg)


# a setting that cannot work -> ConfigError "<setting>=<value>: must be <range>" at start-up,
# before any data is read (the fault campaign's cases first, then their neighbours)
BAD_SETTINGS = [
    ("model.net.num_heads=0", "model.net.num_heads=0: must be an integer >= 1"),
    ("model.net.num_heads=5", "model.net.num_heads=5: must be a divisor of model.net.dim="),
    ("data.dev_fraction=0", "data.dev_fraction=0.0: must be in (0, 1)"),
    ("data.label_tolerance=-1", "data.label_tolerance=-1: must be an integer >= 0"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0: must be an integer"),
    ("trainer.max_steps=0", "trainer.max_steps=0: must be an integer >= 1"),
    ("trainer.max_steps=-1", "trainer.max_steps=-1: must be an integer >= 1"),
    ("trainer.val_check_interval=0", "trainer.val_check_interval=0: must be an integer >= 1"),
    ("+trainer.limit_train_batches=0", "trainer.limit_train_batches=0: must be > 0"),
    ("trainer.log_every_n_steps=0", "trainer.log_every_n_steps=0: must be an integer >= 1"),
    ("checkpoint.every_n_steps=0", "checkpoint.every_n_steps=0: must be an integer >= 1"),
    ("checkpoint.keep=-2", "checkpoint.keep=-2: must be an integer >= 0, or -1"),
    ("max_nonfinite=0", "max_nonfinite=0: must be an integer >= 1"),
    ("progress_bar=fancy", "progress_bar='fancy': must be rich, tqdm or none"),
    ("model.net.dropout=1.0", "model.net.dropout=1.0: must be in [0, 1)"),
    ("model.net.num_layers=0", "model.net.num_layers=0: must be an integer >= 1"),
    ("model.net.conv_position_kernel=4", "model.net.conv_position_kernel=4: must be 0 (none) or"),
    ("model.masking.span=0", "model.masking.span=0: must be an integer >= 1"),
    ("model.masking.fraction=1.5", "model.masking.fraction=1.5: must be in [0, 1]"),
    ("model.optimizer.lr=0", "model.optimizer.lr=0.0: must be > 0"),
    ("model.optimizer.lr=-1e-3", "model.optimizer.lr=-0.001: must be > 0"),
    ("model.optimizer.warmup_fraction=2", "model.optimizer.warmup_fraction=2.0: must be in [0, 1]"),
    ("model.optimizer.betas=[0.9,1.5]", "model.optimizer.betas=[0.9, 1.5]: must be two numbers"),
    ("data.batch_size=0", "data.batch_size=0: must be an integer >= 1"),
    ("data.n_mels=0", "data.n_mels=0: must be an integer >= 1"),
    ("data.num_workers=-1", "data.num_workers=-1: must be an integer >= 0, or null"),
    ("data.normalization=cmvn", "data.normalization='cmvn': must be one of global, utterance"),
]


@pytest.mark.parametrize(("override", "message"), BAD_SETTINGS)
def test_settings_that_cannot_work_are_refused_at_start_up(tmp_path, override, message):
    from speechattn.errors import ConfigError
    from speechattn.tasks.pretrain import run

    cfg = compose("pretrain", [override, f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as refused:
        run(cfg)
    assert str(refused.value).startswith(message)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_prune_fraction_that_is_not_a_number_is_refused(tmp_path):
    """`fraction=abc` is refused by PruneConfig's schema as the config is composed (Hydra
    names the override); a number outside [0, 1] by the job's own check."""
    from hydra.errors import ConfigCompositionException

    from speechattn.errors import ConfigError
    from speechattn.tasks.analysis.prune import run

    with pytest.raises(ConfigCompositionException, match="fraction=abc"):
        compose("prune", [f"heads={tmp_path}/heads.json", "fraction=abc"])
    cfg = compose("prune", [f"heads={tmp_path}/heads.json", "fraction=1.5"])
    with pytest.raises(ConfigError, match=r"^fraction=1.5: must be a number in \[0, 1\]"):
        run(cfg)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.dev_fraction=0", "data.dev_fraction=0.0: must be in (0, 1)"),  # was Lightning's
        ("data.label_tolerance=-1", "data.label_tolerance=-1: must be an integer >= 0"),
    ],
)
def test_downstream_refuses_them_before_reading_data(tmp_path, override, message):
    from speechattn.errors import ConfigError
    from speechattn.tasks.downstream import run

    cfg = compose("downstream", [override, f"output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as refused:
        run(cfg)
    assert str(refused.value).startswith(message)
