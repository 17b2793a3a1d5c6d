//! Server-sent events framing: bytes in, events out. Bytes are buffered until a blank line
//! ends an event, so a chunk boundary anywhere (inside a line, inside a UTF-8 character, in
//! the middle of `\r\n`) changes nothing.

/// One event: its `event:` name, if any, and its `data:` lines joined by `\n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

#[derive(Debug, Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds `bytes` and returns every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, next)) = event_end(&self.buf) {
            let block: Vec<u8> = self.buf.drain(..next).take(end).collect();
            if let Some(e) = parse_block(&String::from_utf8_lossy(&block)) {
                events.push(e);
            }
        }
        events
    }

    /// The event left unterminated when the stream closed, if its lines are whole: some
    /// servers end the last event with a single newline. A stream cut inside a line loses
    /// that line, as the SSE spec says, so a truncated JSON is never taken for a bad one.
    pub fn finish(&mut self) -> Option<SseEvent> {
        let rest = std::mem::take(&mut self.buf);
        if !rest.ends_with(b"\n") && !rest.ends_with(b"\r") {
            return None;
        }
        parse_block(&String::from_utf8_lossy(&rest))
    }
}

/// The end of the first event in `buf` and where the next starts: the first blank line, with
/// `\n`, `\r\n` or `\r` line endings.
fn event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        let eol = match buf[i] {
            b'\n' => 1,
            // A lone `\r` at the buffer's end may be half of `\r\n`: wait for more bytes.
            b'\r' if i + 1 == buf.len() => return None,
            b'\r' if buf[i + 1] == b'\n' => 2,
            b'\r' => 1,
            _ => {
                i += 1;
                continue;
            }
        };
        let after = i + eol;
        match buf.get(after) {
            Some(b'\n') => return Some((i, after + 1)),
            Some(b'\r') => match buf.get(after + 1) {
                Some(b'\n') => return Some((i, after + 2)),
                Some(_) => return Some((i, after + 1)),
                None => return None,
            },
            Some(_) => i = after,
            None => return None,
        }
    }
    None
}

fn parse_block(block: &str) -> Option<SseEvent> {
    let mut event = None;
    let mut data: Option<String> = None;
    for line in block.split(['\n', '\r']) {
        // Comments (`: keep-alive`) carry nothing.
        if line.is_empty() || line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => event = Some(value.to_string()),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            },
            _ => {}
        }
    }
    data.map(|data| SseEvent { event, data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in_pieces(bytes: &[u8], piece: usize) -> Vec<SseEvent> {
        let mut d = SseDecoder::new();
        let mut out = Vec::new();
        for chunk in bytes.chunks(piece) {
            out.extend(d.push(chunk));
        }
        out.extend(d.finish());
        out
    }

    #[test]
    fn events_survive_any_chunking() {
        let stream = "data: {\"a\":1}\n\n: keep-alive\n\nevent: error\ndata: {\"error\":\"x\"}\r\n\r\ndata: é1\ndata: 2\n\ndata: [DONE]\n\n";
        let want = vec![
            SseEvent {
                event: None,
                data: "{\"a\":1}".into(),
            },
            SseEvent {
                event: Some("error".into()),
                data: "{\"error\":\"x\"}".into(),
            },
            SseEvent {
                event: None,
                data: "é1\n2".into(),
            },
            SseEvent {
                event: None,
                data: "[DONE]".into(),
            },
        ];
        for piece in 1..stream.len() {
            assert_eq!(
                decode_in_pieces(stream.as_bytes(), piece),
                want,
                "piece {piece}"
            );
        }
    }

    #[test]
    fn a_line_cut_by_the_close_is_dropped() {
        assert_eq!(decode_in_pieces(b"data: 1\n\ndata: {\"a\"", 4).len(), 1);
    }

    #[test]
    fn an_unterminated_last_event_is_kept() {
        assert_eq!(
            decode_in_pieces(b"data: 1\n\ndata: 2\n", 3),
            vec![
                SseEvent {
                    event: None,
                    data: "1".into()
                },
                SseEvent {
                    event: None,
                    data: "2".into()
                }
            ]
        );
    }
}
