//! Every example config in `configs/` is loaded by the real binary, which must start (or, for P/D
//! roles not available in a single test process, fail with a clear message).

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
