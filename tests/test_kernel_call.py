"""cuflash.kernel_call's launches against a fake driver: the retry on a thread with no context, the error. No GPU."""

import types

import pytest

from cuflash import kernel_call


class FakeDriver:
    """cuLaunchKernel / cuLaunchKernelEx returning the given codes in turn; cuGetErrorName naming them."""

    def __init__(self, monkeypatch, codes):
        self.codes, self.launches, self.made_current = list(codes), 0, []
        monkeypatch.setattr(kernel_call, "_driver", lambda: (self.launch, self.error_name, self.launch))
        monkeypatch.setattr(kernel_call, "_make_current", self.made_current.append)

    def launch(self, *args):
        self.launches += 1
        return self.codes.pop(0)

    @staticmethod
    def error_name(code, name_ref):
        name_ref._obj.value = f"CUDA_ERROR_{code}".encode()
        return 0


def fake_kernel(device_id=3):
    kernel_ = kernel_call.Kernel.__new__(kernel_call.Kernel)
    kernel_.handle, kernel_.smem_bytes, kernel_.device_id = None, 1024, device_id
    return kernel_


ARGS = types.SimpleNamespace(address=None)


@pytest.mark.parametrize("after_prior", [False, True])
def test_a_launch_on_a_thread_without_a_context_makes_the_device_current_and_launches_again(monkeypatch, after_prior):
    driver = FakeDriver(monkeypatch, [kernel_call._CUDA_ERROR_INVALID_CONTEXT, 0])
    launcher = kernel_call.LaunchAfterPrior(fake_kernel()) if after_prior else fake_kernel()
    launcher.launch((2, 1, 1), 128, ARGS, 0)
    assert driver.made_current == [3] and driver.launches == 2


@pytest.mark.parametrize("after_prior", [False, True])
def test_a_failed_launch_raises_with_its_error_and_shape(monkeypatch, after_prior):
    driver = FakeDriver(monkeypatch, [701])
    launcher = kernel_call.LaunchAfterPrior(fake_kernel()) if after_prior else fake_kernel()
    with pytest.raises(RuntimeError, match=r"CUDA_ERROR_701 \(grid \(2, 1, 1\), block 128, 1024 bytes"):
        launcher.launch((2, 1, 1), 128, ARGS, 0)
    assert driver.made_current == [] and driver.launches == 1


def test_a_successful_launch_calls_the_driver_once(monkeypatch):
    driver = FakeDriver(monkeypatch, [0])
    fake_kernel().launch((1, 1, 1), 32, ARGS, 0)
    assert driver.launches == 1 and driver.made_current == []
