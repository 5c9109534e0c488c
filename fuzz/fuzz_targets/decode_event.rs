//! Any bytes through the event decoder and, when they decode, into the Arrow
//! builders: an error, never a panic. The decoder's fast path and serde
//! alone must give the same result.
#![no_main]

use libfuzzer_sys::fuzz_target;
use steamrf_schemas::{Provenance, TableBuilders, decode, decode_slow};

fuzz_target!(|data: &[u8]| {
    let decoded = decode(data);
    assert_eq!(decoded, decode_slow(data), "the fast path and serde disagree");
    if let Ok(event) = decoded {
        let mut b = TableBuilders::default();
        b.append(
            &event,
            Provenance {
                partition: 0,
                offset: 0,
                ingested_at_ms: 0,
            },
        );
        let batches = b.finish().expect("a decoded event always builds");
        assert!(batches.num_rows() <= 1);
    }
});
