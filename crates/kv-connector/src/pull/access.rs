//! Who may read which KV, in one place: the producer's routes ([`KvPeerService`]: handshake,
//! claim, release) and the consumer's admission of `kv_transfer_params` ([`KvAdmission`]).
//!
//! Producer routes (on its OpenAI HTTP port, outside `--api-key`: they have their own checks):
//! - `GET /v1/kv/handshake`: the NIXL metadata a READ needs. With a deployment secret, only for
//!   requests signed with it ([`crate::auth::KV_AUTH_HEADER`]).
//! - `POST /v1/kv/claim` `{"kv_transfer_params": …}`: a consumer asks to read a lease's blocks
//!   before its READ. Granted only for params this producer issued (its engine id, and with a
//!   secret its valid, unexpired signature) naming a live, unclaimed lease with exactly its
//!   blocks ([`LeaseTable::claim`]).
//! - `POST /v1/kv/release` `{"kv_transfer_params": …}`: the proxy gives an unclaimed lease back
//!   after its decode call failed; checked like a claim (an expired signature is fine: releasing
//!   is always safe), answered with what happened.
//! - `POST /v1/kv/push/register` (push mode) a consumer's [`Registration`]: with a secret only
//!   signed requests; the first registration of a transfer id wins, an ended one is refused
//!   with its reason ([`PushRegistry`]).
//!
//! Consumer admission ([`KvAdmission::check`], before the request reaches the engine and before
//! any connection): pull `do_remote_prefill` params need a valid, unexpired signature when the
//! instance has a secret, and a producer in `allowed_producers`; push params (from the proxy,
//! unsigned) only the latter: registering sends a producer nothing it could read KV with (it
//! must fetch the consumer's handshake, signed), and transfer ids are unguessable.

use serde_json::Value;

use super::leases::{LeaseTable, ReleaseOutcome};
use super::HandshakeProvider;
use crate::allowlist::ProducerAllowlist;
use crate::auth::{unix_millis, TransferAuth};
use crate::error::KvConnectorError;
use crate::params::{RemotePrefill, TransferRequest};
use crate::push::protocol::Registration;
use crate::push::registry::{validate as validate_registration, PushRegistry};

/// Where a consumer claims a lease.
pub const CLAIM_PATH: &str = "/v1/kv/claim";
/// Where the proxy releases a lease.
pub const RELEASE_PATH: &str = "/v1/kv/release";
/// The key of the claim and release bodies.
pub const PARAMS_FIELD: &str = "kv_transfer_params";

/// The producer side of the KV routes. Cheap to clone.
#[derive(Debug, Clone)]
pub struct KvPeerService {
    engine_id: String,
    handshake: HandshakeProvider,
    leases: LeaseTable,
    auth: Option<TransferAuth>,
    /// Push mode: where consumers' registrations go.
    push: Option<PushRegistry>,
}

impl KvPeerService {
    pub fn new(
        engine_id: String,
        handshake: HandshakeProvider,
        leases: LeaseTable,
        auth: Option<TransferAuth>,
    ) -> Self {
        KvPeerService {
            engine_id,
            handshake,
            leases,
            auth,
            push: None,
        }
    }

    /// The same service for a push connector: it accepts registrations into `registry`.
    pub fn with_push_registry(mut self, registry: PushRegistry) -> Self {
        self.push = Some(registry);
        self
    }

    /// `POST /v1/kv/push/register` (push mode): a consumer registers its blocks for a transfer.
    /// With a secret, only signed requests; the body must be a well-formed [`Registration`]
    /// (unknown fields refused); the first registration of a transfer id wins. `Ok(false)`: this
    /// instance is not in push mode.
    pub fn register_push(
        &self,
        auth_header: Option<&str>,
        body: &Value,
    ) -> Result<bool, KvConnectorError> {
        let Some(registry) = &self.push else {
            return Ok(false);
        };
        if let Some(auth) = &self.auth {
            auth.verify_request("POST", crate::push::REGISTER_PATH, auth_header)?;
        }
        let reg: Registration = serde_json::from_value(body.clone()).map_err(|e| {
            KvConnectorError::InvalidTransferParams(format!("not a push registration: {e}"))
        })?;
        validate_registration(&reg)?;
        registry.register(reg)?;
        Ok(true)
    }

    /// The handshake JSON for a request carrying `auth_header`; `Ok(None)` until the worker
    /// registered its caches.
    pub fn handshake(&self, auth_header: Option<&str>) -> Result<Option<&str>, KvConnectorError> {
        if let Some(auth) = &self.auth {
            auth.verify_request("GET", super::HANDSHAKE_PATH, auth_header)?;
        }
        Ok(self.handshake.json())
    }

    /// Params of a claim or release body that this producer issued.
    fn own_params(
        &self,
        body: &Value,
        check_expiry: bool,
    ) -> Result<RemotePrefill, KvConnectorError> {
        let params = body.get(PARAMS_FIELD).ok_or_else(|| {
            KvConnectorError::InvalidTransferParams(format!("the body needs {PARAMS_FIELD:?}"))
        })?;
        if let Some(auth) = &self.auth {
            let obj = params.as_object().ok_or_else(|| {
                KvConnectorError::InvalidTransferParams(
                    "kv_transfer_params must be an object".into(),
                )
            })?;
            match auth.verify_params(obj, unix_millis()) {
                Err(KvConnectorError::Expired(_)) if !check_expiry => {}
                other => other?,
            }
        }
        let remote = RemotePrefill::from_params(params)?;
        if remote.remote_engine_id != self.engine_id {
            return Err(KvConnectorError::LeaseRefused(format!(
                "the params name engine {:?}, this producer is {:?}",
                remote.remote_engine_id, self.engine_id
            )));
        }
        Ok(remote)
    }

    /// `POST /v1/kv/claim`: see the module docs.
    pub fn claim(&self, body: &Value) -> Result<(), KvConnectorError> {
        let remote = self.own_params(body, true)?;
        self.leases
            .claim(&remote.remote_request_id, &remote.remote_block_ids)
    }

    /// `POST /v1/kv/release`: see the module docs.
    pub fn release(&self, body: &Value) -> Result<ReleaseOutcome, KvConnectorError> {
        let remote = self.own_params(body, false)?;
        Ok(self
            .leases
            .release(&remote.remote_request_id, &remote.remote_block_ids))
    }
}

/// The consumer's admission of a request's `kv_transfer_params`.
#[derive(Debug, Clone)]
pub struct KvAdmission {
    auth: Option<TransferAuth>,
    allowlist: ProducerAllowlist,
}

impl KvAdmission {
    pub fn new(auth: Option<TransferAuth>, allowlist: ProducerAllowlist) -> Self {
        KvAdmission { auth, allowlist }
    }

    /// Refuses params this instance must not act on; everything else (local and producer
    /// requests, and well-formedness, checked later against the prompt) passes.
    pub fn check(&self, params: Option<&Value>) -> Result<(), KvConnectorError> {
        let Some(Value::Object(obj)) = params else {
            return Ok(());
        };
        if obj.get("do_remote_prefill") != Some(&Value::Bool(true)) {
            return Ok(());
        }
        if !matches!(obj.get("transfer_id"), None | Some(Value::Null)) {
            let TransferRequest::PushConsumer(push) = TransferRequest::parse(params, 0, 1)? else {
                return Ok(());
            };
            // Push params come from the proxy, unsigned: the consumer sends the producer no
            // secret-bearing data (its handshake is fetched with a signed request), so only the
            // address is checked.
            return self.allowlist.check(&push.remote_host, push.remote_port);
        }
        if let Some(auth) = &self.auth {
            auth.verify_params(obj, unix_millis())?;
        }
        let remote = RemotePrefill::from_params(params.expect("matched above"))?;
        self.allowlist
            .check(&remote.remote_host, remote.remote_port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::time::{Duration, Instant};

    fn secret() -> TransferAuth {
        TransferAuth::new(b"a-deployment-secret").unwrap()
    }

    fn issued(auth: Option<&TransferAuth>) -> Value {
        let mut p = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "p0", "remote_request_id": "3-abc", "remote_block_ids": [5, 6],
            "remote_host": "127.0.0.1", "remote_port": 8100, "tp_size": 1});
        if let Some(a) = auth {
            a.sign_params(
                p.as_object_mut().unwrap(),
                unix_millis(),
                Duration::from_secs(30),
            );
        }
        p
    }

    fn service(auth: Option<TransferAuth>) -> (KvPeerService, LeaseTable) {
        let leases = LeaseTable::new();
        leases.issue(
            "3-abc",
            &[vec![5, 6]],
            20,
            Instant::now() + Duration::from_secs(30),
        );
        let s = KvPeerService::new("p0".into(), HandshakeProvider::new(), leases.clone(), auth);
        (s, leases)
    }

    #[test]
    fn claims_need_the_producers_own_signed_params() {
        let (s, _) = service(Some(secret()));
        let unsigned = json!({PARAMS_FIELD: issued(None)});
        assert!(matches!(
            s.claim(&unsigned),
            Err(KvConnectorError::Unauthorized(_))
        ));
        let forged =
            json!({PARAMS_FIELD: issued(Some(&TransferAuth::new(b"someone-elses-key").unwrap()))});
        assert!(matches!(
            s.claim(&forged),
            Err(KvConnectorError::Unauthorized(_))
        ));
        let good = json!({PARAMS_FIELD: issued(Some(&secret()))});
        s.claim(&good).unwrap();
        // The same params again: a replay.
        assert!(matches!(
            s.claim(&good),
            Err(KvConnectorError::LeaseRefused(_))
        ));
        assert!(matches!(
            s.claim(&json!({})),
            Err(KvConnectorError::InvalidTransferParams(_))
        ));
        assert!(matches!(
            s.handshake(None),
            Err(KvConnectorError::Unauthorized(_))
        ));
        let h = secret().sign_request("GET", super::super::HANDSHAKE_PATH);
        assert_eq!(s.handshake(Some(&h)).unwrap(), None, "not published yet");
    }

    #[test]
    fn without_a_secret_the_lease_still_decides() {
        let (s, leases) = service(None);
        let mut other = issued(None);
        other["remote_engine_id"] = json!("p1");
        assert!(matches!(
            s.claim(&json!({PARAMS_FIELD: other})),
            Err(KvConnectorError::LeaseRefused(_))
        ));
        let mut edited = issued(None);
        edited["remote_block_ids"] = json!([1, 2]);
        assert!(s.claim(&json!({PARAMS_FIELD: edited.clone()})).is_err());
        assert_eq!(
            s.release(&json!({PARAMS_FIELD: edited})).unwrap(),
            ReleaseOutcome::Unknown
        );
        assert_eq!(
            s.release(&json!({PARAMS_FIELD: issued(None)})).unwrap(),
            ReleaseOutcome::Released
        );
        assert_eq!(leases.take_released(), vec!["3-abc".to_string()]);
        assert!(s.handshake(None).unwrap().is_none());
    }

    #[test]
    fn admission_checks_signature_expiry_and_producer() {
        let a = secret();
        let adm = KvAdmission::new(Some(a.clone()), ProducerAllowlist::any());
        adm.check(None).unwrap();
        adm.check(Some(&json!({"do_remote_decode": true}))).unwrap();
        adm.check(Some(&issued(Some(&a)))).unwrap();
        assert!(matches!(
            adm.check(Some(&issued(None))),
            Err(KvConnectorError::Unauthorized(_))
        ));
        let mut expired = issued(None);
        a.sign_params(
            expired.as_object_mut().unwrap(),
            1_000,
            Duration::from_secs(1),
        );
        assert!(matches!(
            adm.check(Some(&expired)),
            Err(KvConnectorError::Expired(_))
        ));

        let open = KvAdmission::new(None, ProducerAllowlist::loopback());
        open.check(Some(&issued(None))).unwrap();
        let mut far = issued(None);
        far["remote_host"] = json!("169.254.169.254");
        assert!(matches!(
            open.check(Some(&far)),
            Err(KvConnectorError::ProducerNotAllowed(_))
        ));
    }
}
