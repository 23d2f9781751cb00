-- Argo CD health check for vllm.autotuner.io/VLLMTuningPolicy (vllm-autotuner, docs/gitops.md).
--
-- The operator validates each policy generation and reports it in the Valid condition:
-- Valid=True is Healthy, Valid=False is Degraded (the deployments that use it are held), and a
-- status older than the spec is Progressing. Written for Argo CD's default sandbox (base and
-- table libraries only: no string library).
local hs = {}

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to validate the policy"
  return hs
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to validate generation " .. tostring(generation)
  return hs
end

local valid = nil
if obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    if condition.type == "Valid" then
      valid = condition
    end
  end
end

local message = nil
if valid ~= nil and valid.message ~= nil and valid.message ~= "" then
  message = valid.message
end

if valid ~= nil and valid.status == "True" then
  hs.status = "Healthy"
  hs.message = message or "Policy is valid"
elseif valid ~= nil and valid.status == "False" then
  hs.status = "Degraded"
  hs.message = message or "Policy is invalid"
else
  hs.status = "Progressing"
  hs.message = message or "Waiting for the operator to validate the policy"
end
return hs
