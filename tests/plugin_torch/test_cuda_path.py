"""The CUDA stream/event path, on a CPU: fake streams and events record the order of waits,
records and releases (plugins/torch/cuda.py), on a real 1-rank gloo group; AMP with
``torch.amp.GradScaler("cpu")``. The same code with real CUDA runs in test_gpu.py."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import commsched  # noqa: E402
from commsched.plugins.torch import DistributedOptimizer  # noqa: E402
from commsched.plugins.torch.backends import TorchBackend  # noqa: E402
from commsched.plugins.torch.cuda import CudaTask, DeviceStreams, FakeCuda  # noqa: E402
from commsched.plugins.torch.tensor_ops import TorchOps  # noqa: E402
from commsched.scheduler import Scheduler  # noqa: E402

COMM = "comm:cpu"


pytestmark = pytest.mark.usefixtures("one_rank_group")


def index(log, entry):
    assert entry in log, f"{entry} not in {log}"
    return log.index(entry)


def comm_records(log):
    return [e[2] for e in log if e[0] == "record" and e[1] == COMM]


@pytest.fixture
def sched():
    made = []

    def make(fake, **cfg):
        backend = TorchBackend(timeout_s=10.0, device_streams=DeviceStreams(fake))
        s = Scheduler(backend, TorchOps(), commsched.SchedulerConfig(ordering="fifo", timeout_s=30, **cfg))
        made.append(s)
        return s, backend.device_streams
    yield make
    for s in made:
        s.close(10.0)


def test_ready_event_is_waited_on_the_comm_stream_before_the_collective_and_division_follows(sched):
    fake = FakeCuda(auto_complete=True)
    s, streams = sched(fake)
    x = torch.arange(8, dtype=torch.float32)
    ready = streams.record_ready(x)
    record = CudaTask(streams, ready, divisor=4.0)
    s.wait(s.submit("w", x, 0, ready=record), timeout=30)
    log = fake.log
    waited = index(log, ("wait", COMM, ready.name))
    entered = index(log, ("enter", COMM))
    completion, done = comm_records(log)
    assert index(log, ("record", "compute", ready.name)) < waited < entered
    assert entered < index(log, ("record", COMM, completion))
    # the division is enqueued on the comm stream after the collective, then the done event
    assert log.count(("enter", COMM)) == 2 and record.done_event.name == done
    assert index(log, ("record", COMM, completion)) < len(log) - 1 - log[::-1].index(("enter", COMM))
    torch.testing.assert_close(x, torch.arange(8, dtype=torch.float32) / 4.0, rtol=0, atol=0)


def test_credit_is_released_only_after_the_completion_event_completes(sched):
    fake = FakeCuda()
    s, streams = sched(fake, partition_bytes=64, credit_bytes=64)
    x = torch.ones(32)  # 128 bytes: two pieces, and only one fits in the credit
    future = s.submit("w", x, 0, ready=CudaTask(streams, streams.record_ready(x), divisor=None))
    first = fake.events[_wait_for_comm_record(fake, 1)[0]]
    assert fake.wait_queried(first, 3), "the completion thread does not poll the event"
    assert fake.log.count(("enter", COMM)) == 1, "a second piece started before the first one's event completed"
    assert not future.done()
    first.complete()
    second = fake.events[_wait_for_comm_record(fake, 2)[1]]
    assert fake.wait_queried(second, 1)
    assert not future.done()
    for name in comm_records(fake.log):
        fake.events[name].complete()
    s.wait(future, timeout=30)


def _wait_for_comm_record(fake, n):
    with fake.cv:
        fake.cv.wait_for(lambda: len(comm_records(fake.log)) >= n, 30)
    names = comm_records(fake.log)
    assert len(names) >= n
    return names


def test_buffer_is_released_to_the_allocator_after_its_completion_event(sched):
    fake = FakeCuda(auto_complete=True)
    s, streams = sched(fake, partition_bytes=64)
    x = torch.ones(48)
    s.wait(s.submit("w", x, 0, ready=CudaTask(streams, streams.record_ready(x), divisor=None)), timeout=30)
    releases = [i for i, e in enumerate(fake.log) if e[0] == "release"]
    assert len(releases) == 3  # one per piece
    for i in releases:
        assert fake.log[i - 1][0] == "record" and fake.log[i - 1][1] == COMM  # the piece's completion event


def make_opt(fake, cross=True, **cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                               config=commsched.SchedulerConfig(cross_iteration=cross, timeout_s=30,
                                                                **{"fusion_bytes": 0, **cfg}))  # one task each
    opt._backend.device_streams = DeviceStreams(fake)  # CPU tensors take the stream/event path
    return model, opt


def test_fused_small_gradients_take_one_event_pair_and_update_like_the_reference():
    fake = FakeCuda(auto_complete=True)
    model, opt = make_opt(fake, fusion_bytes=1 << 16)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    opt.synchronize()
    assert list(opt.stats()["fused"]) == ["fused[0.weight..2.bias](4)"]
    assert len([e for e in fake.events.values() if e.timing and e.stream == COMM]) == 3  # one per step
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    opt.close()


def test_next_forward_waits_on_the_done_event_on_the_compute_stream_without_blocking_the_cpu():
    fake = FakeCuda()  # no event ever completes by itself: a CPU wait on completion would hang
    model, opt = make_opt(fake)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    model(x)  # returns although no completion event has completed
    dones = [e for e in fake.events.values() if e.timing and e.stream == COMM]
    assert len(dones) == 4  # one per parameter
    for done in dones:
        waited = index(fake.log, ("wait", "compute", done.name))
        assert index(fake.log, ("record", COMM, done.name)) < waited
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt._scheduler.pending(), "credit was released before the completion events completed"
    for event in list(fake.events.values()):
        event.complete()
    opt.synchronize()
    assert not opt._scheduler.pending()
    opt.close()


def test_bubble_counts_the_gpu_stall_measured_by_timing_events():
    fake = FakeCuda(auto_complete=True)
    model, opt = make_opt(fake)
    x = torch.randn(4, 8)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    mark = len(fake.events)
    model(x)
    opt.zero_grad()
    model(x).square().mean().backward()
    needed = [e for e in list(fake.events.values())[mark:] if e.timing and e.stream == "compute"]
    assert needed, "the forward recorded no timing event on the compute stream"
    # the (fake) GPU finished the first layer's reduction 7 ms after the compute stream needed it
    first_wait = [e for e in fake.log if e[0] == "wait" and e[1] == "compute"][0][2]
    fake.events[first_wait].complete(tick=needed[0].tick + 7)
    opt.step()
    assert opt.stats()["bubble_s"][-1] >= 0.007
    opt.close()


def test_grad_scaler_with_cross_iteration_is_refused_naming_the_alternative():
    model, opt = make_opt(FakeCuda(auto_complete=True))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # GradScaler's note on the grad_scaler= contract
        with pytest.raises(ValueError, match=r"cross_iteration=False.*scaler.step\(opt\)"):
            scaler.step(opt)
    opt.close()


def amp_train(opt, model, scaler, steps, inf_at=None):
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 8)
        opt.zero_grad()
        loss = model(x).square().mean()
        if step == inf_at:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("stream_path", [False, True])
def test_grad_scaler_on_the_synchronous_path_equals_plain_amp_and_skips_inf_steps(stream_path):
    fake = FakeCuda(auto_complete=True)
    model, opt = make_opt(fake, cross=False)
    if not stream_path:
        opt._backend.device_streams = None
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler, ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    amp_train(opt, model, scaler, 4, inf_at=2)
    amp_train(ref_opt, ref, ref_scaler, 4, inf_at=2)
    assert scaler.get_scale() == ref_scaler.get_scale() == 512.0  # the inf step halved the scale
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert any(e[0] == "wait" and e[1] == "compute" for e in fake.log) == stream_path
    opt.close()


def test_grad_scaler_unscale_before_the_gradients_landed_is_an_error():
    model, opt = make_opt(FakeCuda(auto_complete=True), cross=False)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
    scaler.unscale_(opt)  # without opt.synchronize() first
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(commsched.CommschedError, match=r"opt.synchronize\(\) before scaler.unscale_"):
            scaler.step(opt)
    opt.close()
