"""Issue 61: the signature table grows by family, each from real wording, with its root and cascade classes explicit;
the needles that keep it fast never hide a line its pattern matches."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from dflashctl.judge.decode import sniff_codec
from dflashctl.judge.diagnosis import diagnose_lines
from dflashctl.judge.logs import SIG, SIGNATURES, strip_prefix
from dflashctl.judge.signatures import CASCADE, ROOT

CORPUS = Path(__file__).resolve().parents[1] / "logs"

# One real line per family member, as the tool prints it
FAMILIES = {
    "RECOMPILE_LIMIT": [
        "torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached, because fail_on_recompile_limit_hit = "
        "True this is a HARD failure",
        "torch._dynamo.exc.FailOnRecompileLimitHit: recompile_limit reached with fullgraph=True. Excessive "
        "recompilations can degrade performance due to the compilation overhead of each recompilation.",
        "torch._dynamo.exc.FailOnRecompileLimitHit: Hard failure due to fail_on_recompile_limit_hit",
        "torch._dynamo.exc.FailOnCacheLimitHit: cache_size_limit reached",
        "RuntimeError: Detected recompile when torch.compile stance is 'fail_on_recompile'. filename: 'train.py', "
        "function name: 'step', line number: 41",
    ],
    "HOST_OOM": [
        "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
        "(raylet) node_manager.cc:3069: 2 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers "
        "crashed due to other reasons at node (ID: 8289f8, IP: 172.24.0.226) over the last time period.",
        "llama-ft-worker-0   0/1     OOMKilled   0          47m",
        "      Reason:       OOMKilled",
        "Dec 07 16:11:24 gpu-box systemd-oomd[581]: Killed /user.slice/user-1000.slice/user@1000.service/app.slice/"
        "train.service due to memory pressure for /user.slice/user-1000.slice/user@1000.service being 86.80% > 50.00% "
        "for > 20s with reclaim activity",
        "train.service: systemd-oomd killed 19 process(es) in this unit.",
        "Dec 07 16:11:24 gpu-box systemd[1]: train.service: A process of this unit has been killed by the OOM killer.",
        "earlyoom[454]: low memory! at or below SIGTERM limits: mem 10.00%, swap 10.00%",
        'earlyoom[454]: sending SIGTERM to process 9994 uid 1000 "python3": badness 1181, VmRSS 4568 MiB',
    ],
    "DIVERGED": [
        "AssertionError: Rank 13: found NaN in local grad norm in backward pass before data-parallel communication "
        "collective. Device: 5, node: node-15-11",
        "RuntimeError: Rank 255, node n1, device 7, iteration 2: Unexpected result nan (message='found NaN in local "
        "forward loss calculation')",
        "AssertionError: Rank 0: found NaN in local forward loss calculation. Device: 0, node: sky-2d73-user",
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
        "[rank: 0] Monitored metric val_loss = tensor(nan, device='cuda:0') is not finite. Previous best value was "
        "0.357. Signaling Trainer to stop.",
        "ValueError: Detected nan and/or inf values in `c_d1.bias`. Check your forward pass for numerically unstable "
        "operations.",
        "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it cannot be "
        "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
        "`error_if_nonfinite=False`",
    ],
    "PREEMPTED": [
        "I 12-07 03:52:17 controller.py:281] Cluster is preempted or failed (status: STOPPED). Recovering...",
        "The job cluster is preempted or failed.",
        "(bert-qa pid=920210) I 05-04 00:52:46 controller.py:100] The cluster is preempted.",  # its spot controller
        '            "Code": "instance-terminated-no-capacity",',  # a spot request's status
        "systemevent-1796701937044-62a0e8f4b2a61  compute.instances.preempted  us-central1-a/instances/vm-1  200  "
        "DONE    2026-12-07T03:52:17.044-08:00",
        '    "status": {"message": "Instance was preempted."},',
        '{"action": "terminate", "time": "2026-12-07T11:02:41Z"}',
        "2026/12/07 11:00:41 INF Node successfully cordoned and drained node_name=ip-10-0-1-7.ec2.internal "
        'reason="Spot ITN received. Instance will be interrupted at 2026-12-07T11:02:41Z \\n"',
        '    "detail-type": "EC2 Spot Instance Interruption Warning",',
        "Message:          The node was low on resource: memory. Threshold quantity: 100Mi, available: 91244Ki.",
        "Terminated: Pod was terminated in response to imminent node shutdown.",
        "DisruptionTarget=True PreemptionByScheduler default-scheduler: preempting to accommodate a higher priority "
        "pod",
        "  Normal   Preempted  3m    default-scheduler  Preempted by ml/big-job-0 on node gpu-node-3",
        "evicting pod ml/llama-ft-worker-1",  # kubectl drain
        "Message:          Pod The node had condition: [DiskPressure]. ",
    ],
}


@pytest.mark.parametrize("state, line", [(s, ln) for s, lines in FAMILIES.items() for ln in lines])
def test_each_family_members_real_wording_names_its_state(state, line):
    v = diagnose_lines(["step 100 loss 2.31", line])
    assert v.state == state, v


def _corpus_lines() -> list[str]:
    out = []
    for path in sorted([*CORPUS.glob("*/*.log"), *CORPUS.glob("*/*.log.gz")]):
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        codec = sniff_codec(data[:8192])
        text = data.decode(codec if codec != "utf-8" else "utf-8-sig", errors="replace").replace("\0", "")
        out += [strip_prefix(ln)[1] for ln in text.splitlines()]
    return out + [ln for lines in FAMILIES.values() for ln in lines]


def test_every_line_a_signature_matches_holds_one_of_its_needles():
    """The needles only narrow where a pattern runs: a match without one of them would be lost."""
    lines = _corpus_lines()
    missed = [
        (s.name, ln[:100])
        for s in SIGNATURES
        for ln in lines
        if s.pattern.search(ln) and not any(n in ln.lower() for n in s.needles)
    ]
    assert missed == []


def test_every_signature_has_needles_and_a_role_and_cascades_rank_below_roots():
    assert all(s.needles and all(n == n.lower() for n in s.needles) for s in SIGNATURES)
    assert {s.role for s in SIGNATURES} == {ROOT, CASCADE}
    cascade = [s.rank for s in SIGNATURES if s.role == CASCADE]
    assert min(cascade) >= 70 and all(s.rank < 70 for s in SIGNATURES if s.role == ROOT and s.state != "NCCL_ERROR")


@pytest.mark.parametrize(
    "lines, state",
    [
        # a memory monitor's kill is the root: Ray's word that the worker died, the survivors' timeouts follow it
        (
            [
                "(raylet) node_manager.cc:3069: 1 Workers (tasks / actors) killed due to memory pressure (OOM), 0 Workers "  # noqa: E501 - the line as the tool prints it
                "crashed due to other reasons at node (ID: 5c2f, IP: 10.0.0.1) over the last time period.",
                "[rank0]:[E1204 10:02:44.1 7 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout",  # noqa: E501 - the line as the tool prints it
                "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
            ],
            "HOST_OOM",
        ),
        # a rank's own exception before the monitor's kill is the cause
        (
            [
                "Traceback (most recent call last):",
                '  File "t.py", line 1, in <module>',
                "KeyError: 'x'",
                "low memory! at or below SIGTERM limits: mem 10.00%, swap 10.00%",
            ],
            "CRASHED",
        ),
        # a preemption notice, then the SIGTERM it brought: the notice
        (
            [
                '{"action": "terminate", "time": "2026-12-07T11:02:41Z"}',
                "Traceback (most recent call last):",
                '  File "/opt/venv/bin/torchrun", line 8, in <module>',
                "torch.distributed.elastic.multiprocessing.api.SignalException: Process 9 got signal: 15",
            ],
            "PREEMPTED",
        ),
        # a rank's own error before the cloud took the machine: the error
        (
            [
                "Traceback (most recent call last):",
                '  File "t.py", line 1, in <module>',
                "ValueError: bad shard",
                "The job cluster is preempted or failed.",
            ],
            "CRASHED",
        ),
        # the trainer's recompile-limit exception outranks the others' timeouts
        (
            [
                "[rank1]: torch._dynamo.exc.FailOnRecompileLimitHit: Hard failure due to fullgraph=True",
                "[rank0]:[E1204 10:02:44.1 7 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
                "timeout",
            ],
            "RECOMPILE_LIMIT",
        ),
        # Ray Train's summary alone is a crash (its cause went unprinted), never a pass
        (
            [
                "ray.train.base_trainer.TrainingFailedError: The Ray Train run failed. Please inspect the previous error "  # noqa: E501 - the line as the tool prints it
                "messages for a cause."
            ],
            "CRASHED",
        ),
    ],
)
def test_the_root_outranks_its_cascade(lines, state):
    v = diagnose_lines(["step 100 loss 2.31", *lines])
    assert v.state == state, v


@pytest.mark.parametrize(
    "line",
    [
        # fp16's ordinary overflows: DeepSpeed skips the step and lowers the scale, training goes on
        "[2026-12-06 05:13:01,221] [INFO] [loss_scaler.py:190:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping "
        "step. Attempted loss scale: 65536, reducing to 32768",
        # the query asking gcloud for preemptions is none
        '$ gcloud compute operations list --filter="operationType=compute.instances.preempted"',
        # a recompile-limit `raise` in a frame's source line is no exception line
        "    raise FailOnRecompileLimitHit(",
    ],
)
def test_words_of_a_family_that_are_no_failure_decide_nothing(line):
    assert diagnose_lines(["step 100 loss 2.31", line, "step 101 loss 2.30"]).state == "INCOMPLETE"


def test_rays_memory_monitor_is_host_ram_never_the_gpus():
    wrapped = "ray.exceptions.RayTaskError(OutOfMemoryError): ray::_Inner.train() (pid=9, ip=10.0.0.1)"
    v = diagnose_lines(
        [wrapped, "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."]
    )
    assert v.state == "HOST_OOM" and "Ray's memory monitor" in v.reason and "RAY_memory_usage_threshold" in v.advice
    assert not SIG["cuda_oom"].unless.search("torch.OutOfMemoryError: CUDA out of memory.")


def test_the_cloud_and_the_cluster_say_what_to_do():
    v = diagnose_lines(["step 1 loss 2", "Message: The node was low on resource: memory. Threshold quantity: 100Mi"])
    assert v.state == "PREEMPTED" and "low on resource: memory" in v.reason and "memory request" in v.advice
    v = diagnose_lines(["step 1 loss 2", "Spot ITN received. Instance will be interrupted at 2026-12-07T11:02:41Z"])
    assert v.state == "PREEMPTED" and "spot" in v.advice and "newest checkpoint" in v.advice
