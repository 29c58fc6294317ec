"""The monitor's tickets: numbers, anonymous finishes, leases (plain Python, no Ray)."""

from __future__ import annotations

from obsckpt.tickets import Tickets


def _issue(tickets: Tickets, *, step=None, admitted=None, lease=False, last_seen=0.0):
    ticket = tickets.issue(
        step=step,
        kind="checkpoint",
        slot="model",
        rank=0,
        node_id="n",
        pid=1,
        requested=0.0,
        lease=lease,
    )
    ticket.admitted = admitted
    ticket.last_seen = last_seen
    return ticket


class TestNumbers:
    """A ticket number names one save of one monitor incarnation."""

    def test_numbers_are_unique_and_issued_here(self):
        tickets = Tickets()
        numbers = [_issue(tickets).ticket for _ in range(100)]
        assert len(set(numbers)) == 100
        assert all(tickets.issued_here(n) for n in numbers)

    def test_another_incarnation_s_numbers_are_not_issued_here(self):
        # Two incarnations share a base with probability 2**-31.
        earlier, later = Tickets(), Tickets()
        number = _issue(earlier).ticket
        assert not later.issued_here(number)
        assert (
            not later.issued_here(True) and not later.issued_here("1") and not later.issued_here(0)
        )

    def test_close_returns_a_ticket_once(self):
        tickets = Tickets()
        number = _issue(tickets, step=3, admitted=1.0).ticket
        assert tickets.close(number).step == 3
        assert tickets.close(number) is None
        assert len(tickets) == 0


class TestAnonymousFinish:
    """A finish without a ticket (a Trinity caller) closes the oldest admitted save that named no step."""

    def test_oldest_admitted_anonymous_ticket_is_closed(self):
        tickets = Tickets()
        named = _issue(tickets, step=1, admitted=1.0)
        waiting = _issue(tickets)  # not admitted yet: its save has not run
        first = _issue(tickets, admitted=2.0)
        second = _issue(tickets, admitted=3.0)
        assert tickets.close(None) is first
        assert tickets.close(None) is second
        assert tickets.close(None) is None
        assert [t.ticket for t in tickets] == [named.ticket, waiting.ticket]


class TestLeases:
    """A leased, admitted save with no heartbeat for longer than the timeout is stale; its late finish is recognised once."""

    def test_stale_needs_a_lease_an_admission_and_silence(self):
        tickets = Tickets()
        silent = _issue(tickets, step=1, admitted=0.0, lease=True, last_seen=0.0)
        _issue(tickets, step=1, admitted=0.0, lease=False, last_seen=0.0)  # no lease
        _issue(tickets, step=1, admitted=None, lease=True, last_seen=0.0)  # still queued
        beating = _issue(tickets, step=1, admitted=0.0, lease=True, last_seen=0.0)
        tickets.renew([beating.ticket, 12345], now=95.0)
        assert tickets.stale(now=100.0, timeout_s=10.0) == [silent]
        assert tickets.watched(nodes=False)  # a lease is open

    def test_an_expired_ticket_is_closed_and_its_finish_recognised_once(self):
        tickets = Tickets()
        number = _issue(tickets, step=1, admitted=0.0, lease=True).ticket
        assert tickets.expire(number).ticket == number
        assert number not in [t.ticket for t in tickets] and not tickets.watched(nodes=False)
        assert tickets.take_expired(number)
        assert not tickets.take_expired(number)
