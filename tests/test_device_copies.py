"""Host tables on a device (doccp.device_copies): copied once per device, gone with their host tensor.

The ``meta`` device stands in for an accelerator here; tests/test_gpu.py checks on a GPU that
attention layers after a batch's first never stall the host.
"""

from __future__ import annotations

import gc

import torch

from doccp import device_copies
from doccp.device_copies import on_device, to_device


def test_a_tensor_already_there_is_returned_as_is():
    host = torch.arange(5)
    assert to_device(host, "cpu") is host
    assert on_device(host, torch.device("cpu")) is host
    assert not any(key[0] == id(host) for key in device_copies._COPIES)


def test_to_device_copies_every_time():
    host = torch.arange(5)
    a, b = to_device(host, "meta"), to_device(host, "meta")
    assert a.device.type == b.device.type == "meta" and a is not b
    assert a.shape == host.shape and a.dtype == host.dtype


def test_on_device_copies_once_while_the_host_tensor_lives():
    host = torch.arange(7)
    first = on_device(host, "meta")
    assert first.device.type == "meta" and first.shape == (7,)
    assert on_device(host, torch.device("meta")) is first  # the next layer gets the same copy
    other = torch.arange(7)
    assert on_device(other, "meta") is not first  # equal values, another table
    key = (id(host), "meta")
    assert device_copies._COPIES[key] is first
    del host
    gc.collect()
    assert key not in device_copies._COPIES  # no copy outlives its table


def test_views_of_one_buffer_are_tables_of_their_own():
    rows = torch.arange(10)
    parts = torch.split(rows, [4, 6])  # a schedule's rows per peer
    copies = [on_device(p, "meta") for p in parts]
    assert [c.shape[0] for c in copies] == [4, 6]
    assert all(on_device(p, "meta") is c for p, c in zip(parts, copies, strict=True))
