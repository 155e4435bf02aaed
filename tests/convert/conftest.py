import pytest

from tests.models.helpers import destroy_megatron, free_port, init_megatron


@pytest.fixture
def megatron_world_of_one():
    """megatron parallel state over gloo with one process (TP = PP = 1), torn down afterwards."""
    init_megatron(rank=0, world_size=1, port=free_port())
    yield
    destroy_megatron()
