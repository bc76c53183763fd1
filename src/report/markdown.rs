//! Helpers for the markdown tables of the demo and ablation reports (`report.md`): cells written
//! with `writeln!` row by row, so each report keeps its exact bytes.

/// A markdown table cell: `|` escaped as `\|`, line breaks (`\n`, `\r`) as spaces.
pub fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// An optional number with three decimals (`0.125`), or `–` (en dash) when `None`.
pub fn opt3(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.3}")).unwrap_or_else(|| "–".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_escape_pipes_and_line_breaks() {
        assert_eq!(cell("a|b\nc\r"), "a\\|b c ");
        assert_eq!(opt3(Some(0.1 + 0.2)), "0.300");
        assert_eq!(opt3(None), "–");
    }
}
