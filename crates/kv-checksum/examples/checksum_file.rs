//! Prints the checksums of a safetensors file of KV, as `tandem kv-checksum` will:
//! `cargo run -p tandem-kv-checksum --example checksum_file -- FILE BLOCK_SIZE [START_TOKEN [NUM_TOKENS]]`.
//! Used to compare with `tests/reference_checksum.py`.

use std::path::Path;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| args.get(i).map(|s| s.parse::<usize>().expect("a number"));
    let (Some(file), Some(block_size)) = (args.first(), num(1)) else {
        eprintln!("usage: checksum_file FILE BLOCK_SIZE [START_TOKEN [NUM_TOKENS]]");
        std::process::exit(2);
    };
    match tandem_kv_checksum::checksum_safetensors_file(
        Path::new(file),
        block_size,
        num(2).unwrap_or(0),
        num(3),
    ) {
        Ok(json) => println!("{json}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
