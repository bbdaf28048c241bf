"""`flashtrain <stage> [hydra overrides]`, also `python -m launch <stage> ...`.

The config is composed with Hydra's compose API from the structured configs in `conf/`, so
every override is type-checked against its dataclass. Config mistakes and bad inputs end in
one line on stderr and exit code 2; `hydra.run.dir=DIR` places the whole run under DIR.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

EXIT_USER_ERROR = 2
EXIT_INTERNAL = 1  # not the input's fault: a rank or a worker failed

USAGE = """usage: flashtrain <stage> [key=value ...] [--cfg]

Stages:
{stages}

Overrides are Hydra syntax: model=small trainer.max_steps=100 hydra.run.dir=runs/a
--cfg prints the composed config and exits."""


def _fail(message: str, code: int = EXIT_USER_ERROR) -> int:
    print(f"flashtrain: error: {message}", file=sys.stderr)
    return code


def describe_config_error(exc: BaseException) -> str:
    """One line from Hydra/OmegaConf's multi-line errors, naming the offending key."""
    from omegaconf.errors import OmegaConfBaseException

    chain, e = [], exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            first = str(err).strip().splitlines()[0]
            if "not in" in first or "not found" in first:
                return f"unknown config key '{err.full_key}' ({first})"
            return f"bad value for '{err.full_key}': {first}"
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if lines and "Could not find" in lines[0] and "Available options" in str(exc):
        options = []
        for ln in lines[1:]:  # the options follow "Available options:", then Hydra's search path
            if ln.startswith("Config search path"):
                break
            if not ln.startswith("Available"):
                options.append(ln)
        return f"{lines[0]} (available: {', '.join(options)})"
    return " ".join(lines[:2]) if lines else type(exc).__name__


def keyword_alias(override: str) -> str:
    """Config fields named after Python keywords carry a trailing underscore (`rl.async_`); the
    CLI takes the plain spelling too: `rl.async=false` -> `rl.async_=false`."""
    import keyword

    key, sep, value = override.partition("=")
    if not sep:
        return override
    prefix = "".join(c for c in key[:2] if c in "+~")
    parts = key[len(prefix):].split(".")
    return prefix + ".".join(p + "_" if keyword.iskeyword(p) else p for p in parts) + sep + value


# Keys no stage has, each with the key that carries its meaning: Hydra would only say "unknown
# config key", which does not tell the user where the setting is.
OTHER_SPELLINGS = {"init_from": "model.init_from", "rl.policy": "model.init_from"}


def check_spellings(overrides: list[str]) -> None:
    """A ConfigError naming the right key for an override whose key (a leading +, ++ or ~ aside)
    is one of OTHER_SPELLINGS."""
    from conf.errors import ConfigError

    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key in OTHER_SPELLINGS:
            raise ConfigError(f"'{key}' is spelled {OTHER_SPELLINGS[key]}")


def compose(stage: str, overrides: list[str]):
    """Compose the stage's config. Returns (job config without the hydra node, run dir)."""
    from hydra import compose as hydra_compose
    from hydra import initialize
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    check_spellings(overrides)
    GlobalHydra.instance().clear()
    with initialize(version_base=None, config_path=None):
        cfg = hydra_compose(config_name=stage, overrides=[keyword_alias(o) for o in overrides],
                            return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # lets ${now:...} and ${hydra:...} resolve
    run_dir = Path(str(cfg.hydra.run.dir))
    with open_dict(cfg):
        del cfg["hydra"]
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise MissingValue(missing)
    OmegaConf.resolve(cfg)
    return cfg, run_dir


class MissingValue(Exception):
    def __init__(self, keys: list[str]):
        super().__init__(", ".join(keys))
        self.keys = keys


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from launch.stages import all_stages

    stages = all_stages()
    usage = USAGE.format(stages="\n".join(f"  {s.name:<14}{s.help}" for s in stages.values()))
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else EXIT_USER_ERROR
    stage_name, overrides = argv[0], argv[1:]
    if stage_name not in stages:
        return _fail(f"unknown stage '{stage_name}' (available: {', '.join(stages)})")
    print_cfg = "--cfg" in overrides
    overrides = [o for o in overrides if o != "--cfg"]

    import conf
    from conf.errors import RunFailure, UserError
    from launch.launchers import check_launcher, launch, launched_world_size, needs_launch

    conf.register({name: s.config for name, s in stages.items()})
    try:
        cfg, run_dir = compose(stage_name, overrides)
    except MissingValue as e:
        return _fail(f"missing required value for {', '.join(repr(k) for k in e.keys)}")
    except UserError as e:  # check_spellings
        return _fail(str(e))
    except Exception as e:  # Hydra/OmegaConf composition errors
        return _fail(describe_config_error(e))

    from omegaconf import OmegaConf

    config_yaml = OmegaConf.to_yaml(cfg)
    if print_cfg:
        print(config_yaml, end="")
        return 0
    try:
        typed = OmegaConf.to_object(cfg)
    except Exception as e:
        return _fail(describe_config_error(e))

    launcher = getattr(typed, "launcher", None)  # stages that run processes have one
    if launcher is not None:
        try:
            check_launcher(launcher)  # also when it runs in-process (nproc=0 is not one process)
            if needs_launch(launcher):
                if stages[stage_name].preflight is not None:
                    stages[stage_name].preflight(typed, launched_world_size(launcher))
                return launch(launcher, argv, run_dir)
        except UserError as e:
            return _fail(str(e))

    try:
        stages[stage_name].run(typed, run_dir, config_yaml)
    except UserError as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except RunFailure as e:
        return _fail(str(e), EXIT_INTERNAL)
    except RuntimeError as e:
        from trainer.distributed import collective_timeout

        line = collective_timeout(e)
        if line is None:
            raise
        return _fail(line, EXIT_INTERNAL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
