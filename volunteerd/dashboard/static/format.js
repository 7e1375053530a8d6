// How numbers, sizes, durations and times read on the dashboard. Times are Unix seconds
// (as the API sends them) shown in the browser's time zone and locale.

const intFormat = new Intl.NumberFormat();
const compactFormat = new Intl.NumberFormat(undefined, { notation: "compact", maximumFractionDigits: 1 });
const BYTE_UNITS = ["B", "kB", "MB", "GB", "TB", "PB"];
const fixedFormats = new Map();
// What a number field shows: the browser's decimal mark, Latin digits (parseDecimal
// reads it back: Arabic's ٢٫٥ is 2.5 there too, but a person may type either), no
// grouping, float noise cut.
const inputFormat = new Intl.NumberFormat(undefined, {
  numberingSystem: "latn", useGrouping: false, maximumFractionDigits: 10,
});
const plainFormat = new Intl.NumberFormat(undefined, { maximumFractionDigits: 3 });

/** ``digits`` decimals in the browser's locale: 12.5 (en), 12,5 (de). */
function fixed(n, digits) {
  let format = fixedFormats.get(digits);
  if (format === undefined) {
    format = new Intl.NumberFormat(undefined, { minimumFractionDigits: digits, maximumFractionDigits: digits });
    fixedFormats.set(digits, format);
  }
  return format.format(n);
}

/** A setting as the page says it: 2.5 (en), 2,5 (de), up to three decimals. */
export function fmtNumber(n) {
  if (n == null || !Number.isFinite(n)) return "—";
  return plainFormat.format(n);
}

/**
 * A number for a field the user edits, in Latin digits; parseDecimal reads it back.
 * Exactly three decimals get a fourth, a zero: "1.125" is refused as ambiguous (a
 * thousand and 125?), "1.1250" is not.
 */
export function fmtInput(n) {
  if (n == null || !Number.isFinite(n)) return "";
  const text = inputFormat.format(n);
  return ambiguous(text) ? `${text}0` : text;
}

// Unicode's decimal digits (Arabic ٢, Persian ۲, Devanagari २, fullwidth ２, …) and
// marks typed on other keyboards, as parseDecimal reads them.
const OTHER_DIGIT = /[^\P{Nd}0-9]/gu;
const OTHER_MARKS = { "\u066b": ".", "\uff0e": ".", "\uff0c": ",", "\u2212": "-", "\uff0d": "-", "\uff0b": "+" };
const OTHER_MARK = /[\u066b\uff0e\uff0c\u2212\uff0d\uff0b]/g;
// Direction marks Intl puts before a minus in Arabic and Persian ("\u200e-1").
const BIDI_MARKS = /[\u061c\u200e\u200f]/g;
const ISDIGIT = /\p{Nd}/u;

/** "٢" -> "2": Unicode puts every set of decimal digits in a run 0 to 9, so a digit's
 * value is its distance from the start of the run of digits it is in, modulo ten. */
function latinDigit(digit) {
  const code = digit.codePointAt(0);
  let start = code;
  while (ISDIGIT.test(String.fromCodePoint(start - 1))) start -= 1;
  return String((code - start) % 10);
}

function latin(text) {
  return text.replace(BIDI_MARKS, "").replace(OTHER_DIGIT, latinDigit)
    .replace(OTHER_MARK, (mark) => OTHER_MARKS[mark]);
}

// One mark after one to three digits, not all zeros, then exactly three: "1,000" is a
// thousand in English and one in German; "2,5", "0,125", "1234,567" and "1,0000" are not.
const AMBIGUOUS = /^([+-]?)(\d{1,3})([.,])(\d{3})([eE][+-]?\d+)?$/;

function ambiguous(text) {
  const parts = AMBIGUOUS.exec(text);
  return parts !== null && Number(parts[2]) !== 0 ? parts : null;
}

/**
 * A number typed in a field: "2.5" and "2,5" are both 2.5, whatever the browser's
 * language (a type="number" field read "2,5" as 25 in an English browser); digits of
 * any script ("١٫٥"), an exponent ("1e3"). One decimal mark, no thousands separators:
 * "1,234.5" is refused rather than guessed, and so is "1,000" (a thousand in English,
 * one in German: an English 1,000 GB quota was read as 1 GB), with the two ways to
 * write it. ``{ value }`` (null for an empty field) or ``{ error }``, a sentence for
 * the field.
 */
export function parseDecimal(text) {
  const typed = latin(text).trim();
  if (typed === "") return { value: null };
  if ((typed.match(/[.,]/g) ?? []).length > 1) {
    return { error: "one decimal mark and no thousands separators, e.g. 1234.5 or 1234,5" };
  }
  if (!/^[+-]?(\d+[.,]?\d*|[.,]\d+)([eE][+-]?\d+)?$/.test(typed)) return { error: "not a number" };
  const parts = ambiguous(typed);
  if (parts) {
    const [, sign, whole, mark, decimals, exponent = ""] = parts;
    const shortest = decimals.replace(/0+$/, "");
    const fraction = shortest === "" ? "0" : shortest.length === 3 ? `${shortest}0` : shortest;
    return {
      error: `${typed} reads two ways: write ${sign}${whole}${decimals}${exponent}, `
        + `or ${sign}${whole}${mark}${fraction}${exponent} if "${mark}" is the decimal mark`,
    };
  }
  const value = Number(typed.replace(",", "."));
  // JSON.stringify would send 1e999 as null, which the daemon reads as "no change"
  if (!Number.isFinite(value)) return { error: "must be a finite number" };
  return { value };
}

/** 1,234 up to a million, then 1.2M. */
export function fmtCount(n) {
  if (n == null || !Number.isFinite(n)) return "—";
  return Math.abs(n) >= 1e6 ? compactFormat.format(n) : intFormat.format(Math.round(n));
}

/** A per-second rate: one decimal below 100 (0.4, 12.5), whole above (1,234). */
export function fmtRate(n) {
  if (n == null || !Number.isFinite(n)) return "—";
  if (n === 0) return "0";
  return n >= 100 ? intFormat.format(Math.round(n)) : fixed(n, 1);
}

/** Decimal units, three significant digits: 812 B, 1.25 MB, 12.5 GB, 125 GB. */
export function fmtBytes(b) {
  if (b == null || !Number.isFinite(b)) return "—";
  let i = 0;
  while (Math.abs(b) >= 1000 && i < BYTE_UNITS.length - 1) {
    b /= 1000;
    i += 1;
  }
  const digits = i === 0 ? 0 : b < 10 ? 2 : b < 100 ? 1 : 0;
  return `${fixed(b, digits)} ${BYTE_UNITS[i]}`;
}

/** 0.42 s, 8.5 s, 42 s, 3 min 20 s, 42 min, 5 h 12 min, 3 d 4 h. */
export function fmtDuration(s) {
  if (s == null || !Number.isFinite(s)) return "—";
  if (s < 10) return s === 0 ? "0 s" : `${fixed(s, s < 1 ? 2 : 1)} s`;
  if (s < 60) return `${Math.round(s)} s`;
  const m = Math.floor(s / 60);
  if (m < 10) return `${m} min ${Math.floor(s % 60)} s`;
  if (m < 60) return `${m} min`;
  const h = Math.floor(m / 60);
  if (h < 24) return `${h} h ${m % 60} min`;
  return `${Math.floor(h / 24)} d ${h % 24} h`;
}

/** One unit, for "… ago" and "in …": 12 s, 5 min, 3 h, 2 d. */
export function fmtSpan(s) {
  if (s < 60) return `${Math.max(1, Math.round(s))} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${Math.round(s / 3600)} h`;
  return `${Math.round(s / 86400)} d`;
}

export function fmtAgo(t) {
  if (t == null) return "never";
  const s = Date.now() / 1000 - t;
  return s < 5 ? "just now" : `${fmtSpan(s)} ago`;
}

export function sameDay(a, b) {
  return a.getFullYear() === b.getFullYear() && a.getMonth() === b.getMonth()
    && a.getDate() === b.getDate();
}

/** The time of day, with the date when it is not today. */
export function fmtClock(t, { seconds = false } = {}) {
  const d = new Date(t * 1000);
  const time = { hour: "2-digit", minute: "2-digit", ...(seconds ? { second: "2-digit" } : {}) };
  return sameDay(d, new Date())
    ? d.toLocaleTimeString([], time)
    : d.toLocaleString([], { month: "short", day: "numeric", ...time });
}

export function fmtFull(t) {
  return new Date(t * 1000).toLocaleString([], { dateStyle: "medium", timeStyle: "medium" });
}

/** 12D3KooW…a1b2c3: enough to tell peers apart; the full id goes in a title. */
export function shortId(id) {
  return id.length > 16 ? `${id.slice(0, 8)}…${id.slice(-6)}` : id;
}
