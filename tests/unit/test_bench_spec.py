"""``bench spec``'s acceptance by draft position (issue 36 asks for it beside
tokens per step): counted per group from the speculator's cumulative stats,
pooled over rounds, shown in the table."""

from __future__ import annotations

from types import SimpleNamespace

from cluster.bench.spec import acceptance_by_position, decode_run, format_report
from workers.engine.spec_decode import SpecStats


class _Engine:
    """Decodes every request in one token per step and, per step, records one
    drafting step per sequence: a draft of two tokens, the first accepted."""

    def __init__(self) -> None:
        self.stats = SpecStats(accepted_per_position=[0, 0], proposed_per_position=[0, 0])
        self.scheduler = SimpleNamespace(speculator=SimpleNamespace(stats=self.stats))
        self.num_steps, self.schedule_seconds, self._left = 0, 0.0, {}

    def add_request(self, req) -> None:
        self._left[req.request_id] = req.max_tokens

    def has_unfinished_requests(self) -> bool:
        return any(self._left.values())

    def step(self):
        self.num_steps += 1
        outs = []
        for rid, left in self._left.items():
            if left:
                self._left[rid] = left - 1
                outs.append(SimpleNamespace(request_id=rid, new_token_ids=[7]))
                if left < self._max:  # decode steps draft (prefill does not)
                    self.stats.num_drafts += 1
                    self.stats.num_draft_tokens += 2
                    self.stats.num_accepted_tokens += 1
                    self.stats.proposed_per_position[0] += 1
                    self.stats.proposed_per_position[1] += 1
                    self.stats.accepted_per_position[0] += 1
        return outs


def _llm(output_len: int) -> SimpleNamespace:
    engine = _Engine()
    engine._max = output_len
    counter = iter(range(100))
    return SimpleNamespace(engine=engine, make_request=lambda prompt, params: SimpleNamespace(
        request_id=str(next(counter)), max_tokens=params.max_tokens))


def test_decode_run_counts_each_groups_drafts_by_position():
    # 4 prompts, 2 per group, 5 tokens each: 4 decode steps per sequence draft [accepted, rejected].
    result = decode_run(_llm(5), [[1, 2]] * 4, 5, group_size=2)
    assert result["proposed_per_position"] == [16, 16]
    assert result["accepted_per_position"] == [16, 0]
    assert result["drafts"] == 16 and result["mean_acceptance_length"] == 2.0


def test_acceptance_by_position_pools_rounds_and_counts_only_drafts_that_reached_a_position():
    rounds = [{"accepted_per_position": [3, 1, 0], "proposed_per_position": [10, 4, 0]},
              {"accepted_per_position": [5, 2, 0], "proposed_per_position": [10, 6, 0]}]
    got = acceptance_by_position(rounds)
    assert got["acceptance_per_position"] == [0.4, 0.3, None]
    assert got["proposed_per_position"] == [20, 10, 0]


def test_table_prints_acceptance_by_position_per_mode():
    def entry(tps, **extra):
        return {"decode_tokens_per_s": tps, "schedule_ms_per_step": 0.1, "step_ms": 20.0, **extra}

    spec = {"acceptance_rate": 0.3, "mean_acceptance_length": 1.9, "draft_tokens": 30, "identical_to_off": True}
    report = {"speculative_config": {"method": "eagle"}, "output_len": 8, "rounds": 2, "cases": [{
        "workload": "chat", "batch_size": 8, "off": entry(50.0),
        "eagle": entry(55.0, acceptance_per_position=[0.4, 0.25, None], proposed_per_position=[20, 8, 0], **spec),
        "ngram": entry(49.0, acceptance_per_position=[], proposed_per_position=[], **{**spec, "draft_tokens": 0})}]}
    lines = format_report(report, ["off", "eagle", "ngram"])
    row = next(line for line in lines if "acceptance by position" in line and line.startswith("chat"))
    assert "eagle 40% 25% - (of 20 drafts)" in row and "ngram  (of 0 drafts)" in row


def test_ratios_pair_each_round_with_off_and_counts_pool_over_rounds():
    from cluster.bench.spec import paired_and_pooled

    off = [{"decode_tokens_per_s": 100.0, "steps": 40}, {"decode_tokens_per_s": 50.0, "steps": 40}]
    # The machine halved its speed between the rounds: the ratio of medians (75 / 82.5) hides that each
    # round ran 1.1x and 1.0x.
    mode = [{"decode_tokens_per_s": 110.0, "steps": 30, "draft_tokens": 12, "drafts": 4, "accepted_tokens": 6},
            {"decode_tokens_per_s": 50.0, "steps": 40, "draft_tokens": 0, "drafts": 0, "accepted_tokens": 0}]
    got = paired_and_pooled(off, mode)
    assert got["ratio_by_round"] == [1.1, 1.0] and got["ratio_per_round_median"] == 1.05
    assert got["pooled_acceptance_rate"] == 0.5 and got["pooled_tokens_per_drafting_step"] == 2.5
    assert got["pooled_tokens_per_step"] == 80 / 70


def test_table_shows_the_per_round_ratio_and_its_range():
    spec = {"acceptance_rate": 0.0, "mean_acceptance_length": 0.0, "draft_tokens": 0, "identical_to_off": True,
            "ratio_by_round": [0.94, 1.0, 1.05], "ratio_per_round_median": 1.0, "pooled_draft_tokens": 12,
            "pooled_acceptance_rate": 0.25, "pooled_tokens_per_drafting_step": 1.5}
    report = {"speculative_config": {"method": "eagle"}, "output_len": 8, "rounds": 3, "cases": [{
        "workload": "chat", "batch_size": 8, "off": {"decode_tokens_per_s": 50.0, "schedule_ms_per_step": 0.1,
                                                      "step_ms": 20.0},
        "eagle": {"decode_tokens_per_s": 49.0, "schedule_ms_per_step": 0.1, "step_ms": 20.0, **spec}}]}
    row = next(line for line in format_report(report, ["off", "eagle"]) if line.startswith("| chat")
               or line.startswith("chat  "))
    assert "1.00x [0.94-1.05]" in row and "25%" in row and "1.50" in row
