//! Helpers shared by the benchmark binaries.

/// The median of `v` (sorted in place); the mean of the two middle values for an even count.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}
