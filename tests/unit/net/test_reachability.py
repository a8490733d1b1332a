"""The reachability probe (cotrain.net.reachability).

Here, in the test process alone; the rest in tests/swarm/test_reachability.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.utils.multiaddr import Multiaddr

from cotrain.access import possession
from cotrain.net import reachability

RUN = "probe-run"


def test_a_request_names_tcp_ports_only_and_is_checked_before_anything_is_dialed():
    ports = reachability.checked_ports(
        "/ip4/10.1.2.3/tcp/4001\n/ip6/::1/udp/4001/quic\n/dns4/a.example/tcp/1\n/ip4/10.9.9.9/tcp/4001"
    )
    assert ports == [4001, 1]  # their hosts are never dialed; UDP and repeated ports left out
    many = "\n".join(f"/ip4/10.0.0.1/tcp/{p}" for p in range(1, reachability.MAX_ADDRESSES + 1))
    assert len(reachability.checked_ports(many)) == reachability.MAX_PORTS
    for bad in (
        "",
        "\n".join(["/ip4/10.0.0.1/tcp/1"] * (reachability.MAX_ADDRESSES + 1)),
        "/ip4/10.0.0.1/tcp/1/p2p/12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t",
        "/ip4/10.0.0.1/tcp/1/p2p-circuit",
        "/ip4/10.0.0.1/udp/1/quic",  # no TCP port at all
        "/ip4/10.0.0.1",
        "not an address",
        "/dns4/" + "a" * reachability.MAX_ADDRESS_CHARS + "/tcp/1",
    ):
        with pytest.raises(ValueError):
            reachability.checked_ports(bad)


def test_the_dialed_host_is_the_address_the_askers_connection_came_from():
    asker = PeerID.from_base58("12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t")
    other = PeerID.from_base58("12D3KooWQ1nTnkz3jWJfQxEqYs1XNjfk3WDdmqkhKZpGvSMSq4eT")
    relayed = Multiaddr(f"/ip4/10.0.0.9/tcp/4001/p2p/{other}/p2p-circuit")
    peers = [
        PeerInfo(other, [Multiaddr("/ip4/10.0.0.8/tcp/1")]),
        PeerInfo(asker, [relayed, Multiaddr("/ip6/2001:db8::1/tcp/5")]),
    ]
    assert reachability.asker_host(peers, asker) == ("ip6", "2001:db8::1")
    assert reachability.asker_host([PeerInfo(asker, [relayed])], asker) is None
    assert reachability.asker_host(peers[:1], asker) is None


def test_a_private_swarm_serves_the_probe_to_token_holders_who_prove_their_key(tmp_path):
    from cotrain.access import AccessControl
    from support.auth import issue

    alice = AccessControl.for_token(RUN, str(issue(tmp_path, "alice")))
    mallory = AccessControl.for_token(RUN, str(issue(tmp_path, "mallory", key="other.key")))
    server = AccessControl.for_authority(RUN, str(tmp_path / "authority.key"))
    service = reachability.DialBackService(p2p=None, access=server)
    me = PeerID.from_base58("12D3KooWGvMubipKpiSJAGyrUfBEqBNQZAuACmdnb8437fXoXL7t")
    them = PeerID.from_base58("12D3KooWQ1nTnkz3jWJfQxEqYs1XNjfk3WDdmqkhKZpGvSMSq4eT")
    context = SimpleNamespace(remote_id=me, local_id=them)

    def refusal(request) -> str:
        return service._refusal(request, context)

    assert refusal(reachability._request(["/ip4/127.0.0.1/tcp/1"], me, them, alice)) == ""
    assert "no access token" in refusal(reachability._request(["/ip4/127.0.0.1/tcp/1"], me, them, None))
    assert "not issued by this swarm" in refusal(reachability._request([], me, them, mallory))
    replayed = reachability._request([], me, them, alice)
    assert refusal(replayed) == "" and "replayed" in refusal(replayed)
    assert "not signed" in refusal(reachability._request([], me, me, alice))  # made for another peer
    stale = reachability._request([], me, them, alice)
    stale.time -= 2 * possession.MAX_CLOCK_SKEW
    assert "old or ahead" in refusal(stale)
    bare = reachability._request([], me, them, alice)  # a token copied from elsewhere, without its key
    signed = possession.payload(
        reachability.PURPOSE, RUN, me.to_bytes(), them.to_bytes(), bare.time, bare.nonce
    )
    bare.signature = mallory.own().key.sign(signed)
    assert "not signed" in refusal(bare)
    config = possession.payload("cotrain-config-request/1", RUN, me.to_bytes(), them.to_bytes(), 0.0, b"")
    assert config != signed  # a proof for another purpose is not this one's
