"""Which speculative decoding the engine runs, and what its drafts are priced by.

The builder places drafts, the scheduler's `DraftPolicy` decides how many each request gets and
the suffix proposer proposes them; this sets all three for a `SpeculativeConfig` (or none), and
keeps the step times drafts are priced by per method and loop for the engine's life.
"""

from __future__ import annotations

from tandem.config import SpeculativeConfig
from tandem.engine.grammar import allowed_prefix
from tandem.execution.batch import BatchBuilder
from tandem.metrics import StepRecord
from tandem.scheduling.draft_policy import DraftPolicy, StepCosts
from tandem.scheduling.kv_groups import KVGroups
from tandem.scheduling.scheduler import ScheduledBatch, ScheduledRequest, Scheduler
from tandem.scheduling.suffix_proposer import SuffixProposer


def check_speculation(spec: SpeculativeConfig | None, groups: KVGroups) -> None:
    """A draft model reads every earlier position through the target's blocks, which a window
    gives back."""
    if spec is not None and groups.windowed and spec.method == "draft_model":
        raise ValueError(
            "speculative_config method 'draft_model' is not supported with a sliding-window "
            "model (its blocks before the window are freed); use 'ngram'"
        )


class Speculation:
    def __init__(
        self, loaded: SpeculativeConfig | None, scheduler: Scheduler, builder: BatchBuilder
    ):
        """`loaded`: the engine's configured speculation, whose draft model (if any) it loaded."""
        self.loaded = loaded
        self.scheduler = scheduler
        self.builder = builder
        self._step_costs: dict[tuple[str, int], StepCosts] = {}

    def use(self, spec: SpeculativeConfig | None, depth: int) -> None:
        """Speculate as `spec` says (None: not at all) in the loop of `depth` steps in flight."""
        check_speculation(spec, self.scheduler.groups)
        loaded = self.loaded
        same_draft = loaded is not None and loaded.model == spec.model if spec else False
        if spec is not None and spec.method == "draft_model" and not same_draft:
            raise ValueError(
                "a draft model must be loaded with the engine "
                "(EngineConfig.speculative_config): this engine has none or another"
            )
        self.builder.speculative = spec
        self.scheduler.drafts = (
            None
            if spec is None
            else DraftPolicy(spec.num_speculative_tokens, spec.adaptive, self._costs(spec, depth))
        )
        suffix = spec is not None and spec.method == "suffix"
        self.scheduler.proposer = SuffixProposer(spec, allowed_prefix) if suffix else None

    def loop_changed(self, depth: int) -> None:
        """The loop switched: price drafts by that loop's step times."""
        if self.scheduler.drafts is not None:
            self.scheduler.drafts.costs = self._costs(self.builder.speculative, depth)

    def _costs(self, spec: SpeculativeConfig, depth: int) -> StepCosts:
        """The step times drafts are priced by, kept per method and loop for the engine's life:
        what a step of n tokens costs is the device's and the model's, so speculation switched
        off and on again (`Engine.configure`) does not time its steps afresh, drafting less
        meanwhile."""
        return self._step_costs.setdefault((spec.method, depth), StepCosts())

    def count(self, record: StepRecord, item: ScheduledRequest, kept: int) -> None:
        """A retired verification of `item`'s drafts that kept `kept` tokens (its own one too)."""
        record.drafted += item.num_drafts
        record.accepted += kept - 1
        record.verified += 1
        item.request.speculation.count(item.num_drafts, kept - 1)
        self.scheduler.drafts.observe(item.request, item.num_drafts, kept - 1)

    def time_step(self, batch: ScheduledBatch, record: StepRecord) -> None:
        """A retired step of decodes only: its device time prices the drafts of later steps."""
        if self.scheduler.drafts is not None and batch.num_decodes == len(batch.items):
            device = record.device[1] - record.device[0] - record.device_wait
            self.scheduler.drafts.observe_step(record.num_tokens, device)
