"""The `convert` stage: the public DeepSeek-V4.1-Flash checkpoint layout in and out.

  flashtrain convert import=DIR [out=CKPTS]            public layout -> a weights-only flashtrain
                                                      checkpoint <out>/step_00000000 (default out:
                                                      <run dir>/checkpoints); train from it with
                                                      model.init_from=<out or the run dir>
  flashtrain convert export=DIR checkpoint=CKPT       a flashtrain checkpoint -> the public layout,
                                                      a directory the public inference code loads
                                                      as it is (weights, config.json, tokenizer)

`import` is a Python keyword: the field is `import_`, and the CLI takes `import=` for it. The model
config (model=flash by default) must describe the checkpoint; an unset model.vocab_size is taken from
config.json (import) or from the checkpoint's embedding (export). launcher.nproc=N shares the parts
among N processes.

Export reads two things besides the weights: the tokenizer (the tokenizer.json every checkpoint
carries, or tokenizer=PATH) and the checkpoint's origin, the public directory its weights first came
from (recorded by import and by every run started from one; origin=DIR when it moved, origin=none to
do without): its tensors of modules flashtrain does not train are written back unchanged, and its
scales keep untrained weights byte-identical.

The DSpark drafter (`mtp.*`) is a module of its own (model/dspark.py). `drafter=` says what becomes
of it: on import, auto (default) imports a source's drafter into <out>/drafter (a weights-only
checkpoints dir: rl.drafter=<out>/drafter) and none carries it through unchanged; on export, a
drafter checkpoint (a `flashtrain dspark` run, its checkpoints dir or one checkpoint, or an import's
drafter dir) is written as the release's mtp.* blocks, auto (default) writes the origin's drafter
back unchanged, if it has one, and none leaves any drafter out.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from conf.launcher import LauncherConfig
from conf.model import ModelConfig


@dataclass
class ConvertConfig:
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"model": "flash"}, {"launcher": "local"}])
    stage: str = "convert"
    import_: Optional[str] = None  # a public-layout directory to import
    out: Optional[str] = None  # import: the checkpoints directory to write (None: <run dir>/checkpoints)
    export: Optional[str] = None  # a directory to write the public layout into
    checkpoint: Optional[str] = None  # export: a flashtrain checkpoint, a run's checkpoints/ dir or a run dir
    # export: the public directory the weights came from (None: as recorded; none)
    origin: Optional[str] = None
    tokenizer: Optional[str] = None  # export: a tokenizer.json (None: the one the checkpoint carries)
    drafter: Optional[str] = None  # the DSpark drafter: auto (None) | none | export: a drafter checkpoint
    model: ModelConfig = MISSING
    launcher: LauncherConfig = MISSING
