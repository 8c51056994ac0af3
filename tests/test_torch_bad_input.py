"""Bad input to the PyTorch ScaleCom that needs a model or a Horovod job; the constructor's arguments
and load_state_dict are in the table of tests/test_bad_input_table.py."""

import pytest
import torch

from hvd_scalecom.torch import ScaleCom


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))


def test_accepts_torch_dtypes_and_names():
    a = ScaleCom(model().named_parameters(), value_dtype=torch.float16, index_dtype=torch.int64)
    b = ScaleCom(model().named_parameters(), value_dtype="float16", index_dtype="int64")
    assert a.config == b.config and a.config.value_dtype == "float16"


def test_tensor_that_is_no_parameters_gradient():
    net = model()
    compression = ScaleCom(net.named_parameters())
    with pytest.raises(ValueError, match="not the gradient of any parameter in named_parameters"):
        compression.compress(torch.zeros(30, 40))


def test_adasum_is_a_clear_error(horovod_job):
    from hvd_scalecom.launch import HorovodRunError
    with pytest.raises(HorovodRunError, match="Adasum"):
        horovod_job("torch_scalecom.py", {"op": "adasum", "steps": 1}, np=2, timeout=120)


@pytest.mark.parametrize("per_rank, differing", [
    ({"1": {"ratio": 0.02}}, "ratio"),
    ({"2": {"leader": "staggered"}}, "leader"),
    ({"0": {"min_numel": 100}, "2": {"beta": 0.25}}, "beta, min_numel"),
    ({"1": {"drop_last_param": True}}, "parameter_digest, parameters"),
])
def test_ranks_that_disagree_all_get_one_clear_error(horovod_job, per_rank, differing):
    from hvd_scalecom.launch import HorovodRunError
    with pytest.raises(HorovodRunError) as failure:
        horovod_job("torch_scalecom.py", {"steps": 2, "per_rank": per_rank}, np=3, timeout=120)
    report = str(failure.value)
    for rank in range(3):
        section = report.split(f"----- rank {rank} -----", 1)[1].split("-----", 1)[0]
        assert f"ScaleCom is configured differently on different ranks ({differing} differ" in section
