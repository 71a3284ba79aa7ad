//! Metric names of the HTTP edge, as constants, and the helpers that record them.
//!
//! Invariant: no label carries anything a client sends; the edge's metrics have no labels at all.

use metrics::{counter, describe_counter, describe_gauge, gauge};

/// Connections being served now (each holds one of `max_connections` permits).
pub const CONNECTIONS_OPEN: &str = "tandem:http_connections_open";
/// Connections accepted over `max_connections` and closed at once.
pub const CONNECTIONS_REJECTED_TOTAL: &str = "tandem:http_connections_rejected_total";
/// Connections closed because their request headers did not arrive within
/// `header_read_timeout` (idle keep-alive connections included).
pub const HEADER_READ_TIMEOUTS_TOTAL: &str = "tandem:http_header_read_timeouts_total";
/// Requests answered 401 for a missing or wrong API key.
pub const UNAUTHORIZED_TOTAL: &str = "tandem:http_unauthorized_total";

/// Registers help texts (harmless to call more than once).
pub fn describe() {
    describe_gauge!(CONNECTIONS_OPEN, "HTTP connections being served");
    describe_counter!(
        CONNECTIONS_REJECTED_TOTAL,
        "HTTP connections closed at once because max_connections were open"
    );
    describe_counter!(
        HEADER_READ_TIMEOUTS_TOTAL,
        "HTTP connections closed because request headers did not arrive in time"
    );
    describe_counter!(
        UNAUTHORIZED_TOTAL,
        "Requests answered 401 for a missing or wrong API key"
    );
}

pub(crate) fn connection_opened() {
    gauge!(CONNECTIONS_OPEN).increment(1.0);
}

pub(crate) fn connection_closed() {
    gauge!(CONNECTIONS_OPEN).decrement(1.0);
}

pub(crate) fn connection_rejected() {
    counter!(CONNECTIONS_REJECTED_TOTAL).increment(1);
}

pub(crate) fn header_read_timed_out() {
    counter!(HEADER_READ_TIMEOUTS_TOTAL).increment(1);
}

pub(crate) fn unauthorized() {
    counter!(UNAUTHORIZED_TOTAL).increment(1);
}
