"""The devices each vLLM server the gateway starts sees (`replica_environment`)."""

from gateway.app import replica_environment
from gateway.settings import Settings


def test_a_single_replica_sees_every_gpu_unless_told_which() -> None:
    assert replica_environment(Settings.load(), 0) == {}
    # Serving on the first GPU, training on the second (KAIZEN_TRAIN_GPUS=1).
    assert replica_environment(Settings.load(vllm_replica_gpus="0"), 0) == {"CUDA_VISIBLE_DEVICES": "0"}


def test_several_replicas_get_a_gpu_each_or_the_devices_named() -> None:
    two = Settings.load(vllm_replicas=2)
    assert [replica_environment(two, i) for i in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    named = Settings.load(vllm_replicas=2, vllm_replica_gpus="0,1;2,3", vllm_replica_cpus="0-7;8-15")
    assert replica_environment(named, 1) == {
        "CUDA_VISIBLE_DEVICES": "2,3",
        "VLLM_CPU_OMP_THREADS_BIND": "8-15",
    }
