//! Every example config in `configs/` is loaded by the real binary: the single-instance ones
//! start and answer; the P/D trios of each mode start and serve a request through their proxy.

mod common;

use common::Server;

#[test]
fn single_instance_configs_start() {
    let dir = common::repo_root().join("configs");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if !name.starts_with("single") {
            continue;
        }
        let s = Server::serve(&["--config", path.to_str().unwrap()]);
        assert_eq!(
            common::http_get_status(&s.url("/health")),
            Some(200),
            "{name}"
        );
        n += 1;
    }
    assert!(
        n >= 1,
        "no single-instance config found in {}",
        dir.display()
    );
}

/// The P/D example configs of both modes (`pd-{pull,push}-{prefill,decode,proxy}.toml`) start,
/// and a request through their proxy is served with its KV moved and verified. The ports in the
/// files are replaced by free ones (flags win over the file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_configs_of_both_modes_serve_through_their_proxy() {
    common::require_model();
    let dir = common::repo_root().join("configs");
    for mode in ["pull", "push"] {
        let file = |role: &str| {
            dir.join(format!("pd-{mode}-{role}.toml"))
                .to_str()
                .unwrap()
                .to_string()
        };
        let prefill = Server::serve(&["--config", &file("prefill")]);
        let decode = Server::serve(&["--config", &file("decode")]);
        let proxy = Server::start(
            "proxy",
            &[
                "--config",
                &file("proxy"),
                "--prefill",
                &prefill.base,
                "--decode",
                &decode.base,
            ],
            &[],
        );
        let ids = common::greedy_ids(&proxy.base, "The capital of France is", 6).await;
        assert_eq!(ids.len(), 6, "{mode}");
        let verified = decode
            .metric("tandem:kv_checksum_loads_total", &[("verdict", "verified")])
            .await;
        assert_eq!(verified, Some(1.0), "{mode}: the load was verified");
        common::wait_all_free(&[&prefill, &decode]).await;
    }
}
