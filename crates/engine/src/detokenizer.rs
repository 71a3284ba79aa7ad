//! Incremental detokenization and stop strings.
//!
//! Text is emitted only once it is stable: a token whose bytes end inside a UTF-8 character is held
//! until the character completes, and while stop strings are set, the last `max_stop_len - 1`
//! bytes are held back until it is clear they do not start a stop string. A stop string ends the
//! request; it is not part of the output unless `include_stop_str_in_output` is set.

/// Turns token ids into text; implemented by the model's tokenizer.
pub trait Detokenize: Send + Sync {
    fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String;
}

/// Tokens of the prompt decoded with the first output tokens, so that a leading space or a
/// multi-token character decodes as it would in context.
const CONTEXT_TOKENS: usize = 5;

/// The text state of one request's output.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    prefix_offset: usize,
    read_offset: usize,
    skip_special_tokens: bool,
    stop: Vec<String>,
    include_stop: bool,
    max_stop_len: usize,
    /// All output text decoded so far (possibly ending in held-back bytes).
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
}

/// Result of feeding new tokens.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DetokenizedDelta {
    pub text: String,
    /// A stop string matched; the request must finish.
    pub stopped_by: Option<String>,
}

impl IncrementalDetokenizer {
    /// `num_prompt_tokens`: where the output starts in the request's token ids.
    pub fn new(
        num_prompt_tokens: usize,
        skip_special_tokens: bool,
        stop: Vec<String>,
        include_stop: bool,
    ) -> Self {
        let start = num_prompt_tokens.saturating_sub(CONTEXT_TOKENS);
        let max_stop_len = stop.iter().map(String::len).max().unwrap_or(0);
        IncrementalDetokenizer {
            prefix_offset: start,
            read_offset: num_prompt_tokens,
            skip_special_tokens,
            stop,
            include_stop,
            max_stop_len,
            text: String::new(),
            emitted: 0,
        }
    }

    /// The output text so far, including bytes not yet emitted.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Decodes the tokens appended to `all_ids` since the last call. With `finished`, everything
    /// left is emitted.
    pub fn step(
        &mut self,
        tokenizer: &dyn Detokenize,
        all_ids: &[u32],
        finished: bool,
    ) -> DetokenizedDelta {
        let prefix = tokenizer.decode(
            &all_ids[self.prefix_offset..self.read_offset],
            self.skip_special_tokens,
        );
        let full = tokenizer.decode(&all_ids[self.prefix_offset..], self.skip_special_tokens);
        let stable = !full.ends_with('\u{FFFD}');
        let search_from = self.text.len().saturating_sub(self.max_stop_len);
        if full.len() > prefix.len() && stable && full.is_char_boundary(prefix.len()) {
            self.text.push_str(&full[prefix.len()..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = all_ids.len();
        }
        let mut stopped_by = None;
        if !self.stop.is_empty() {
            let mut from = search_from;
            while !self.text.is_char_boundary(from) {
                from -= 1;
            }
            let hit = self
                .stop
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| (from + p, s)))
                .min_by_key(|(p, _)| *p);
            if let Some((pos, s)) = hit {
                let end = if self.include_stop {
                    pos + s.len()
                } else {
                    pos
                };
                self.text.truncate(end);
                stopped_by = Some(s.clone());
            }
        }
        let done = finished || stopped_by.is_some();
        let mut upto = if done || self.max_stop_len == 0 {
            self.text.len()
        } else {
            self.text.len().saturating_sub(self.max_stop_len - 1)
        };
        upto = upto.max(self.emitted.min(self.text.len()));
        while !self.text.is_char_boundary(upto) {
            upto -= 1;
        }
        let text = if upto > self.emitted {
            let t = self.text[self.emitted..upto].to_string();
            self.emitted = upto;
            t
        } else {
            String::new()
        };
        DetokenizedDelta { text, stopped_by }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A toy tokenizer: id n < 256 is byte n; ids >= 256 are special and decode to "<sN>".
    pub(crate) struct ByteTokenizer;
    impl Detokenize for ByteTokenizer {
        fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
            let mut bytes = Vec::new();
            for &i in ids {
                if i < 256 {
                    bytes.push(i as u8);
                } else if !skip_special_tokens {
                    bytes.extend_from_slice(format!("<s{i}>").as_bytes());
                }
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    fn ids(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    fn run(prompt: &str, out: &[u32], stop: &[&str], include: bool) -> (String, Option<String>) {
        let mut all = ids(prompt);
        let mut d = IncrementalDetokenizer::new(
            all.len(),
            true,
            stop.iter().map(|s| s.to_string()).collect(),
            include,
        );
        let mut text = String::new();
        for (i, &t) in out.iter().enumerate() {
            all.push(t);
            let delta = d.step(&ByteTokenizer, &all, i + 1 == out.len());
            text.push_str(&delta.text);
            if delta.stopped_by.is_some() {
                return (text, delta.stopped_by);
            }
        }
        (text, None)
    }

    #[test]
    fn multibyte_characters_are_emitted_whole() {
        let out = ids("héllo ✓");
        let mut all = ids("p");
        let mut d = IncrementalDetokenizer::new(1, true, vec![], false);
        let mut pieces = Vec::new();
        for t in out {
            all.push(t);
            pieces.push(d.step(&ByteTokenizer, &all, false).text);
        }
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        assert_eq!(pieces.concat(), "héllo ✓");
    }

    #[test]
    fn stop_string_is_cut_and_not_emitted() {
        let (text, stop) = run("Q:", &ids("one two STOP three"), &["STOP"], false);
        assert_eq!(text, "one two ");
        assert_eq!(stop.as_deref(), Some("STOP"));
        let (text, _) = run("Q:", &ids("one two STOP three"), &["STOP"], true);
        assert_eq!(text, "one two STOP");
    }

    #[test]
    fn partial_stop_string_is_held_back_then_released() {
        let (text, stop) = run("", &ids("abST"), &["STOP"], false);
        assert_eq!(stop, None);
        assert_eq!(text, "abST", "released at finish");
        let mut all = vec![];
        let mut d = IncrementalDetokenizer::new(0, true, vec!["STOP".into()], false);
        let mut emitted = String::new();
        for t in ids("abST") {
            all.push(t);
            emitted.push_str(&d.step(&ByteTokenizer, &all, false).text);
        }
        assert_eq!(emitted, "a", "'bST' may still become a stop string");
    }

    #[test]
    fn special_tokens_are_skipped() {
        let (text, _) = run("x", &[104, 300, 105], &[], false);
        assert_eq!(text, "hi");
    }
}
