"""The multi-node rank contract read from the environment the operator sets on each pod."""

import pytest

from stallfree.engine.parallel.env import DEFAULT_DIST_PORT, read_contract


def test_defaults_are_one_local_node():
    c = read_contract({})
    assert (c.num_nodes, c.node_rank, c.is_leader) == (1, 0, True)
    assert c.master_addr == "127.0.0.1" and c.master_port == DEFAULT_DIST_PORT
    assert c.control_port == DEFAULT_DIST_PORT + 1
    assert list(c.ranks(4)) == [0, 1, 2, 3]


def test_operator_environment_of_a_follower_pod():
    env = {
        "STALLFREE_NUM_NODES": "2",
        "STALLFREE_NODE_RANK": "1",
        "STALLFREE_LEADER_ADDRESS": "m-0-0.m-headless.ns.svc",
        "MASTER_ADDR": "m-0-0.m-headless.ns.svc",
        "MASTER_PORT": "29500",
        "STALLFREE_ADMIN_TOKEN": "s3cret",
    }
    c = read_contract(env)
    assert not c.is_leader
    assert c.init_method == "tcp://m-0-0.m-headless.ns.svc:29500"
    assert c.authkey == b"s3cret"
    assert list(c.ranks(8)) == [4, 5, 6, 7]  # tp=4 x pp=2: stage 1 lives on node 1
    assert c.ranks_per_node(8) == 4


def test_master_addr_defaults_to_the_leader_and_control_port_is_settable():
    c = read_contract({"STALLFREE_LEADER_ADDRESS": "lead", "STALLFREE_CONTROL_PORT": "4000"})
    assert c.master_addr == "lead" and c.control_port == 4000


@pytest.mark.parametrize(
    "env, words",
    [
        ({"STALLFREE_NUM_NODES": "two"}, "STALLFREE_NUM_NODES='two' is not an integer"),
        ({"STALLFREE_NUM_NODES": "0"}, "must be >= 1"),
        ({"STALLFREE_NUM_NODES": "2", "STALLFREE_NODE_RANK": "2", "STALLFREE_ADMIN_TOKEN": "x"}, "below"),
        ({"MASTER_PORT": "70000"}, "below 65536"),
        ({"STALLFREE_NUM_NODES": "2"}, "shared secret"),
    ],
)
def test_bad_environment_is_refused_with_the_variable_named(env, words):
    with pytest.raises(ValueError, match=words):
        read_contract(env)


def test_world_must_spread_evenly_over_nodes():
    c = read_contract({"STALLFREE_NUM_NODES": "2", "STALLFREE_PARALLEL_AUTHKEY": "k"})
    with pytest.raises(ValueError, match="cannot be spread evenly"):
        c.ranks(3)
