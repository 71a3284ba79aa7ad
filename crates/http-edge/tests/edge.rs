//! `serve` over real sockets: idle and half-sent connections cannot starve `/health`, live
//! connections never exceed the limit, and shutdown drains within its bound.

use std::time::{Duration, Instant};

use axum::routing::get;
use axum::Router;
use tandem_http_edge::{serve, serve_with_stats, EdgeLimits, EdgeStats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

fn app() -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                "slow"
            }),
        )
        .route("/forever", get(std::future::pending::<&'static str>))
}

struct Server {
    url: String,
    addr: std::net::SocketAddr,
    stats: EdgeStats,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(limits: EdgeLimits) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = EdgeStats::default();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(serve_with_stats(
        listener,
        app(),
        limits,
        stats.clone(),
        async {
            stopped.await.ok();
        },
    ));
    Server {
        url: format!("http://{addr}"),
        addr,
        stats,
        stop,
        task,
    }
}

fn fresh_client(timeout: Duration) -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(timeout)
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// Opens `n` sockets that never finish a request: a third send nothing, a third half a request
/// line, a third a whole request and then sit idle on the keep-alive connection. Then `/health`
/// must answer within 3 s, live connections must never have exceeded 32, and the server must
/// have closed every held socket.
async fn idle_sockets_do_not_starve_health(n: usize) {
    const LIMIT: usize = 32;
    let limits = EdgeLimits {
        max_connections: LIMIT,
        header_read_timeout: Duration::from_secs(1),
        ..EdgeLimits::default()
    };
    let server = start(limits).await;
    let started = Instant::now();
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let mut socket = TcpStream::connect(server.addr).await.unwrap();
        // A rejected socket may already be closed: its write can fail, which is fine.
        let _ = match i % 3 {
            0 => Ok(()),
            1 => socket.write_all(b"GET /heal").await,
            _ => {
                socket
                    .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                    .await
            }
        };
        held.push(socket);
    }

    let deadline = started + Duration::from_secs(3);
    let client = fresh_client(Duration::from_millis(500));
    let mut answered = None;
    while Instant::now() < deadline {
        if let Ok(response) = client.get(format!("{}/health", server.url)).send().await {
            answered = Some((response.status(), started.elapsed()));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, after) = answered.unwrap_or_else(|| {
        panic!(
            "/health did not answer within 3 s with {n} idle sockets open \
             (live {}, rejected {}, header timeouts {})",
            server.stats.live(),
            server.stats.rejected(),
            server.stats.header_timeouts()
        )
    });
    assert_eq!(status, 200);
    assert!(after < Duration::from_secs(3), "{after:?}");
    assert!(
        server.stats.peak() <= LIMIT,
        "{} connections were served at once, over the limit of {LIMIT}",
        server.stats.peak()
    );
    assert!(
        server.stats.rejected() > 0,
        "some sockets were over the limit"
    );
    assert!(server.stats.header_timeouts() > 0);

    // Every held socket is closed by the server (EOF or reset), within the timeout and a margin.
    for (i, mut socket) in held.into_iter().enumerate() {
        let closed = tokio::time::timeout(Duration::from_secs(3), async {
            let mut buf = [0u8; 1024];
            loop {
                match socket.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "socket {i} (kind {}) still open", i % 3);
    }
    server.stop.send(()).unwrap();
    server.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_idle_sockets_do_not_starve_health_and_the_limit_holds() {
    idle_sockets_do_not_starve_health(64).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_twenty_idle_sockets_do_not_starve_health() {
    idle_sockets_do_not_starve_health(320).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_connections_serve_several_requests() {
    let server = start(EdgeLimits::default()).await;
    // Three requests, one after the other, on one socket (a pooled client may race its pool and
    // open a second connection; a socket cannot).
    let addr = server.url.trim_start_matches("http://").to_string();
    let mut socket = TcpStream::connect(&addr).await.unwrap();
    for _ in 0..3 {
        socket
            .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"ok") {
            let n = socket.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(
            got.starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&got)
        );
    }
    assert_eq!(server.stats.accepted(), 1, "one connection, reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_requests_in_flight_then_stops_listening() {
    let server = start(EdgeLimits::default()).await;
    let url = server.url.clone();
    let slow = tokio::spawn(async move {
        let response = fresh_client(Duration::from_secs(5))
            .get(format!("{url}/slow"))
            .send()
            .await?;
        response.text().await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(server.stats.live(), 1);
    server.stop.send(()).unwrap();
    let returned = tokio::time::timeout(Duration::from_secs(5), server.task)
        .await
        .expect("serve returns once the slow answer is sent");
    returned.unwrap().unwrap();
    assert_eq!(slow.await.unwrap().unwrap(), "slow");
    assert!(
        TcpStream::connect(server.addr).await.is_err(),
        "no longer listening"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_by_its_timeout() {
    let limits = EdgeLimits::default().with_shutdown_timeout(Duration::from_millis(300));
    let server = start(limits).await;
    let url = server.url.clone();
    let _forever = tokio::spawn(async move {
        fresh_client(Duration::from_secs(30))
            .get(format!("{url}/forever"))
            .send()
            .await
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let stopping = Instant::now();
    server.stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(3), server.task)
        .await
        .expect("serve returns at the shutdown timeout")
        .unwrap()
        .unwrap();
    assert!(stopping.elapsed() >= Duration::from_millis(250));
}

#[tokio::test]
async fn invalid_limits_are_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let limits = EdgeLimits {
        max_connections: 0,
        ..EdgeLimits::default()
    };
    let error = serve(listener, app(), limits, std::future::pending())
        .await
        .unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
}
