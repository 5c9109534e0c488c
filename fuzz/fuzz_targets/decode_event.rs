//! Any bytes through the event decoder and, when they decode, into the Arrow
//! builders: an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use steamrf_schemas::{Provenance, TableBuilders, decode};

fuzz_target!(|data: &[u8]| {
    if let Ok(event) = decode(data) {
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
