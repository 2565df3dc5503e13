"""The run spec (`RunSpec`) in sections, and what goes with it: the embedded default run, the
states of a run, the checks of the files a spec names. Everything is imported from here:
`from services.contracts.runspec import RunSpec`.

- `spec`: `RunSpec`, the table of its sections (`SECTIONS`, `SECTION_OF`, `FLAT_FIELDS`), the
  flat form's mapping, `EMBEDDED_DEFAULTS`;
- `data`, `training`, `rollout`, `episode`: the sections (`sampling` is
  `contracts.sampling.SamplingParams`);
- `task_files`: the model folder and task file checks, prompt templates;
- `states`: `RunState`, `FINAL_STATES`, `LIVE_STATES`.
"""

from services.contracts.runspec.data import (
    BUILTIN_REWARDS,
    USER_REWARD,
    DataSection,
    ScoringSection,
)
from services.contracts.runspec.episode import (
    BUILTIN_ENVIRONMENTS,
    USER_ENVIRONMENT,
    EpisodeSection,
    ToolFormat,
)
from services.contracts.runspec.rollout import FaultsSection, RolloutSection
from services.contracts.runspec.spec import (
    DATASET_FIELDS,
    EMBEDDED_DEFAULTS,
    EMBEDDED_PRETRAIN_STEPS,
    FLAT_FIELDS,
    SECTION_OF,
    SECTIONS,
    TASK_PRESETS,
    RunSpec,
    place_of,
)
from services.contracts.runspec.states import FINAL_STATES, LIVE_STATES, RunState
from services.contracts.runspec.task_files import (
    MAX_PATH_CHARS,
    MAX_TEXT_CHARS,
    ModelFolderError,
    TaskFileError,
    check_text_file,
    shorten_path,
    template_fields,
)
from services.contracts.runspec.training import (
    LORA_FIELDS,
    LoraSection,
    LossSection,
    OptimizerSection,
    TrainingSection,
)
from services.contracts.sampling import SamplingParams

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "BUILTIN_REWARDS",
    "DATASET_FIELDS",
    "EMBEDDED_DEFAULTS",
    "EMBEDDED_PRETRAIN_STEPS",
    "FINAL_STATES",
    "FLAT_FIELDS",
    "LIVE_STATES",
    "LORA_FIELDS",
    "MAX_PATH_CHARS",
    "MAX_TEXT_CHARS",
    "SECTIONS",
    "SECTION_OF",
    "TASK_PRESETS",
    "USER_ENVIRONMENT",
    "USER_REWARD",
    "DataSection",
    "EpisodeSection",
    "FaultsSection",
    "LoraSection",
    "LossSection",
    "ModelFolderError",
    "OptimizerSection",
    "RolloutSection",
    "RunSpec",
    "RunState",
    "SamplingParams",
    "ScoringSection",
    "TaskFileError",
    "ToolFormat",
    "TrainingSection",
    "check_text_file",
    "place_of",
    "shorten_path",
    "template_fields",
]
