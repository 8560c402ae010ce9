"""Where the control plane may send trajectories: the URLs a policy's configuration names.

A policy's scoring webhook (`rewards.scorer.webhook_url`) and judge (`rewards.judge.api_base`) are written by
whoever holds an admin key, and Kaizen then POSTs whole trajectories there and stores what comes back as rewards
(comments included, which the dashboard shows). Pointed at a listener inside the network (a metadata service on
169.254.169.254, an admin port on loopback), that is a way to reach it from the gateway's host. So such a URL is:

- `http` or `https` with a host, whenever a configuration is read (`url_problem`);
- unless the operator opts in (`KAIZEN_OUTBOUND_PRIVATE_NETWORKS`), one whose host resolves only to global
  addresses (`address_problem`): checked when the policy is created and again at every call, where the request
  connects to the very address that was checked (`PinnedTransport`), so a name that resolves differently a moment
  later (DNS rebinding) cannot slip through; redirects are not followed, and proxies from the environment are not
  used (they would connect on the request's behalf, to an address nobody checked).

The operator's own settings (`KAIZEN_JUDGE_API_BASE`, the engine's URL) are trusted: whoever sets them sets the
opt-in too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

import httpx

SCHEMES = frozenset({"http", "https"})
#: Longest wait for a host name's addresses when a policy is created (calls are bounded by their own timeouts).
RESOLVE_TIMEOUT_S = 5.0
OPT_IN = "KAIZEN_OUTBOUND_PRIVATE_NETWORKS"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[list[Address]]]


class OutboundRefused(Exception):
    """A request to a URL a policy names was not sent: its host resolves to an address it may not reach."""


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a webhook's or judge's URL (not http(s), no host), or None when it can."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"not a URL: {exc}"
    if parsed.scheme not in SCHEMES:
        return f"must be an http:// or https:// URL, not {parsed.scheme + '://' if parsed.scheme else url!r}"
    if not parsed.host:
        return "must name a host"
    return None


def non_global(address: Address) -> str | None:
    """What kind of address this is when it is not a global unicast one (loopback, private, ...), else None."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (where cloud metadata services answer)"
    if address.is_private:
        return "a private address"
    if address.is_multicast:
        return "a multicast address"
    if not address.is_global:
        return "a reserved or shared address"
    return None


async def resolve_host(host: str, port: int) -> list[Address]:
    """Every address `host` resolves to now (an address literal, in any form `getaddrinfo` reads, to itself)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[Address] = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])  # fe80::1%eth0: the zone is no part
        if address not in found:
            found.append(address)
    return found


def _port(url: httpx.URL) -> int:
    return url.port or (443 if url.scheme == "https" else 80)


def refusal(host: str, addresses: list[Address]) -> str | None:
    """Why a request to `host` (resolved to `addresses`) may not be sent without the opt-in, or None."""
    for address in addresses:
        kind = non_global(address)
        if kind is not None:
            shown = f"{host} is" if host == str(address) else f"{host} resolves to {address}, which is"
            return (
                f"{shown} {kind}; URLs in a policy's configuration may reach only global addresses unless the "
                f"operator sets {OPT_IN}=true"
            )
    return None


async def address_problem(url: str, *, resolve: Resolve = resolve_host) -> str | None:
    """Why `url` may not be reached without the opt-in (its host resolves to a non-global address), or None.

    Raises `OSError` (or `TimeoutError`) when the name does not resolve: whether it may be reached is then unknown."""
    parsed = httpx.URL(url)
    return refusal(parsed.host, await resolve(parsed.host, _port(parsed)))


class PinnedTransport(httpx.AsyncHTTPTransport):
    """Connects to the address it checked: each request's host is resolved once, refused (`OutboundRefused`) when
    an address is not global and private networks are not allowed, and the connection goes to the first address
    with the request's own `Host` header and, over TLS, its own name for SNI and the certificate check."""

    def __init__(self, *, private_networks: bool, resolve: Resolve = resolve_host) -> None:
        super().__init__()
        self.private_networks = private_networks
        self.resolve = resolve

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        try:
            addresses = await self.resolve(url.host, _port(url))
        except OSError as exc:
            raise httpx.ConnectError(f"{url.host} does not resolve: {exc}", request=request) from exc
        if not addresses:
            raise httpx.ConnectError(f"{url.host} resolves to no address", request=request)
        if not self.private_networks:
            refused = refusal(url.host, addresses)
            if refused is not None:
                raise OutboundRefused(refused)
        if url.scheme == "https":
            request.extensions = {**request.extensions, "sni_hostname": url.host}
        request.url = url.copy_with(host=str(addresses[0]))
        try:
            return await super().handle_async_request(request)
        finally:
            request.url = url  # what the caller sees (errors, `response.url`) names the host it asked for


def policy_client(*, private_networks: bool, timeout: httpx.Timeout | float) -> httpx.AsyncClient:
    """The HTTP client for URLs a policy names: pinned to checked addresses, no redirects, no proxies."""
    return httpx.AsyncClient(
        transport=PinnedTransport(private_networks=private_networks),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
    )
