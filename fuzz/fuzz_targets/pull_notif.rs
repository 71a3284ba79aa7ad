//! Fuzzes the decoder of the pull protocol's NIXL notifications ([`PullNotif::decode`]): any
//! peer that has a NIXL connection to a producer can send it bytes.
//!
//! Properties: nothing panics; whatever decodes carries a non-empty id and encodes back to
//! exactly the input bytes (the decoder reads nothing it would not write); an encoded
//! notification with a non-empty id decodes to itself.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_kv_connector::pull::protocol::{DONE_PREFIX, RENEW_PREFIX};
use tandem_kv_connector::pull::PullNotif;

fuzz_target!(|data: &[u8]| {
    if let Some(n) = PullNotif::decode(data) {
        let (PullNotif::Done(id) | PullNotif::Renew(id)) = n;
        assert!(!id.is_empty());
        assert_eq!(n.encode(), data, "encode(decode(x)) != x");
        let prefix = match n {
            PullNotif::Done(_) => DONE_PREFIX,
            PullNotif::Renew(_) => RENEW_PREFIX,
        };
        assert!(data.starts_with(prefix));
    }
    // The input's tail as an id, under both prefixes.
    let id = String::from_utf8_lossy(data);
    for n in [PullNotif::Done(&id), PullNotif::Renew(&id)] {
        let bytes = n.encode();
        let back = PullNotif::decode(&bytes);
        if id.is_empty() {
            assert_eq!(back, None);
        } else {
            assert_eq!(back, Some(n), "decode(encode(x)) != x");
        }
    }
});
