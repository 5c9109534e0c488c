//! Any bytes as a `/v1/retrieve` or `/v1/recommend` body: a field error,
//! never a panic; an accepted query vector is always finite.
#![no_main]

use libfuzzer_sys::fuzz_target;
use steamrf_schemas::api::{self, RecommendRequest, RetrieveRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = api::parse::<RetrieveRequest>(data) {
        if r.check(4).is_ok() {
            if let Some(v) = &r.query_vector {
                assert!(v.len() == 4 && v.iter().all(|x| x.is_finite()));
            }
        }
    }
    if let Ok(r) = api::parse::<RecommendRequest>(data) {
        if r.check().is_ok() {
            assert!(!r.candidates.is_empty() && r.candidates.len() <= api::MAX_CANDIDATES);
        }
    }
});
