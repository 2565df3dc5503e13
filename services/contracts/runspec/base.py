"""What every section of the run spec shares: unknown fields and NaN or Infinity refused (JSON
has neither, so such a spec is never stored)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """One section of `RunSpec` (data, scoring, training, ...): a pydantic model of its own."""

    # populate_by_name: a field with an old name (kl_coef, clip_range) is also set by its own
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
