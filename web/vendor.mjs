// Copies the built browser files of the pinned npm packages (and their licences) into
// static/vendor/. Run: `npm ci && npm run vendor` (from web/).
import { build } from "esbuild";
import { cpSync, mkdirSync, rmSync, writeFileSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const nm = join(here, "node_modules");
const out = join(here, "static", "vendor");
const version = (p) => JSON.parse(readFileSync(join(nm, p, "package.json"), "utf8")).version;

rmSync(out, { recursive: true, force: true });
const copy = (from, to) => {
  mkdirSync(dirname(join(out, to)), { recursive: true });
  cpSync(join(nm, from), join(out, to));
};

// marked: the ESM build is already minified.
copy("marked/lib/marked.esm.js", "marked/marked.esm.js");
copy("marked/LICENSE", "marked/LICENSE");

// DOMPurify: ships an unminified ESM build; minify it (keeping its licence comment).
await build({
  entryPoints: [join(nm, "dompurify/dist/purify.es.mjs")],
  outfile: join(out, "dompurify/purify.es.min.js"),
  format: "esm", minify: true, bundle: false, legalComments: "inline", logLevel: "warning",
});
copy("dompurify/LICENSE", "dompurify/LICENSE");
copy("dompurify/LICENSE-MPL", "dompurify/LICENSE-MPL");

// highlight.js: the prebuilt ESM bundle with the common languages, plus two themes.
copy("@highlightjs/cdn-assets/es/highlight.min.js", "highlight.js/highlight.min.js");
copy("@highlightjs/cdn-assets/styles/github.min.css", "highlight.js/github.min.css");
copy("@highlightjs/cdn-assets/styles/github-dark.min.css", "highlight.js/github-dark.min.css");
copy("@highlightjs/cdn-assets/LICENSE", "highlight.js/LICENSE");

const pkgs = { marked: "marked", dompurify: "dompurify", "highlight.js": "@highlightjs/cdn-assets" };
const lines = Object.entries(pkgs).map(
  ([dir, pkg]) => `${dir}/\tnpm ${pkg}@${version(pkg)}`,
);
writeFileSync(
  join(out, "VERSIONS.txt"),
  "Vendored from the npm registry by web/vendor.mjs; licences beside each file.\n" +
    lines.join("\n") + "\n",
);
console.log("vendored into", out);
