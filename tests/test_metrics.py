from verispec.decode import StepRecord
from verispec.metrics import mean_accepted_length, per_candidate_acceptance


def rec(tested, ranks):
    return StepRecord(drafted=6, draft_depth=2, accepted_length=len(ranks) + 1, accepted_ranks=tuple(ranks),
                      tested=tuple(tested), emitted=(), draft_s=0.0, target_s=0.0, verify_s=0.0)


def test_per_candidate_acceptance_by_hand():
    steps = [
        rec([1, 3], [0]),  # depth 0: candidate 1 accepted; depth 1: 3 tested, all rejected
        rec([2, 1], [1, 0]),  # depth 0: 1 rejected, 2 accepted; depth 1: candidate 1 accepted
        rec([3], []),  # depth 0: all 3 rejected
    ]
    # candidate 1: tested 5 times (every depth visit), accepted twice
    # candidate 2: tested 3 times (visits with >= 2 tests), accepted once
    # candidate 3: tested twice, never accepted
    assert per_candidate_acceptance(steps) == [2 / 5, 1 / 3, 0.0]
    assert mean_accepted_length(steps) == (2 + 3 + 1) / 3
