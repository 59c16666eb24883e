"""Which image-URL addresses the front-end may fetch (`is_public_address`): classification only, no network."""

from __future__ import annotations

import ipaddress

import pytest

from http_frontend.parsing.media import is_public_address

REFUSED = [
    "127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254", "0.0.0.0", "100.64.0.1",
    "100.127.255.254", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1", "ff02::1",
    "64:ff9b::7f00:1",        # NAT64 of 127.0.0.1
    "64:ff9b::808:808",       # NAT64 of a public address: still a translator's address
    "64:ff9b:1::a00:1",       # local-use NAT64
    "::7f00:1", "::808:808",  # IPv4-compatible
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:8.8.8.8",  # IPv4-mapped
    "2002:7f00:1::1", "2002:0808:0808::1",  # 6to4
]
ALLOWED = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2001:4860:4860::8888"]


@pytest.mark.parametrize("address", REFUSED)
def test_private_translated_and_special_addresses_are_refused(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ALLOWED)
def test_global_unicast_addresses_pass(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))
