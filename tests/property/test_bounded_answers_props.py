"""A WaitJobs answer of bounded weight (``kvxfer.serving.jobs._heading``, what the local lane sends): over
any finished jobs and any bound, the answers taken one after another report every job once, oldest first,
and each stays within the bound unless it is a single job."""

from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from kvxfer.serving.jobs import JOB_WEIGHT, _heading


@given(st.lists(st.integers(1, 70_000), max_size=40), st.integers(1, 200_000), st.randoms())
def test_answers_taken_in_turn_report_every_job_once_in_order_within_the_bound(sizes, bound, rng):
    jobs = [SimpleNamespace(job_id=i + 1, batch=range(n)) for i, n in enumerate(sizes)]
    left = jobs[:]
    rng.shuffle(left)  # the table's order is not the jobs' order
    reported = []
    while left:
        answer = _heading(left, bound)
        assert answer, "an answer always reports a job when one has finished"
        weight = sum(len(j.batch) + JOB_WEIGHT for j in answer)
        assert weight <= bound or len(answer) == 1
        reported += answer
        left = [j for j in left if j not in answer]
    assert [j.job_id for j in reported] == [j.job_id for j in jobs]
