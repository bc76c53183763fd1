use super::*;

/// Width and height of a PNG from its IHDR header (the test charts' size check).
pub(crate) fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    (w, h)
}

#[test]
fn line_chart_and_histogram_helpers() {
    let dir = tempfile::tempdir().unwrap();
    let series = vec![
        ("combined".to_string(), vec![(0.0, 0.17), (12.0, 0.4), (36.0, 0.81)]),
        ("binary".to_string(), vec![(0.0, 0.17), (12.0, 0.2), (36.0, 0.25)]),
    ];
    let p = dir.path().join("arms.png");
    line_chart(&p, "Arms", "interactions (count)", "score (fraction)", &series).unwrap();
    assert_eq!(png_size(&std::fs::read(&p).unwrap()), (1000, 600));
    let bad = vec![("x".to_string(), vec![(0.0, f64::NAN)])];
    let e = line_chart(&p, "t", "x", "y", &bad).unwrap_err();
    assert!(e.to_string().contains("series \"x\": point 0 is not finite"), "{e}");
    // Empty input still draws axes.
    line_chart(dir.path().join("empty.png"), "t", "x", "y", &[]).unwrap();

    let h = dir.path().join("hist.png");
    let hs = vec![("a".to_string(), vec![0.0, 1.0, 2.0, 3.0, 4.0]), ("b".to_string(), vec![2.5, 2.5])];
    histogram(&h, "Rewards", "reward (−1 to 1)", &hs, 4).unwrap();
    assert_eq!(png_size(&std::fs::read(&h).unwrap()), (1000, 600));
    assert!(histogram(&h, "t", "x", &hs, 0).unwrap_err().to_string().contains("bins must be at least 1, got 0"));
    assert!(histogram(&h, "t", "x", &[("n".to_string(), vec![1.0, f64::INFINITY])], 3).unwrap_err().to_string().contains("value 1 is not finite"));
}

#[test]
fn bins_and_ranges() {
    let (lo, hi, c) = bin_counts(&[("a".to_string(), vec![0.0, 1.0, 2.0, 3.0, 4.0]), ("b".to_string(), vec![2.5])], 2);
    assert_eq!((lo, hi), (0.0, 4.0));
    assert_eq!(c, vec![vec![2, 3], vec![0, 1]]); // the maximum goes into the last bin
    let (lo, hi, c) = bin_counts(&[("a".to_string(), vec![7.0, 7.0])], 3);
    assert_eq!((lo, hi), (6.5, 7.5));
    assert_eq!(c, vec![vec![0, 2, 0]]);
    assert_eq!(padded_range([0.0, 10.0].into_iter()), (-0.5, 10.5));
    assert_eq!(padded_range([3.0].into_iter()), (2.0, 4.0));
    assert_eq!(padded_range(std::iter::empty()), (0.0, 1.0));
    assert_eq!((tick(5.0), tick(0.25), tick(0.1 + 0.2), tick(-2.0)), ("5".into(), "0.25".into(), "0.3".into(), "-2".into()));
}
