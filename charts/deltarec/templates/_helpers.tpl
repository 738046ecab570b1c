{{/* Names and labels shared by every object of the chart. */}}

{{- define "deltarec.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "deltarec.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "deltarec.serviceAccountName" -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}

{{/* The credentials Secret's keys as environment variables, key by key (credentials.keys: the
code's CREDENTIAL_ENV), each optional; nothing without credentials.existingSecret. */}}
{{- define "deltarec.credentialEnv" -}}
{{- if .Values.credentials.existingSecret }}
{{- range .Values.credentials.keys }}
- name: {{ . }}
  valueFrom:
    secretKeyRef:
      name: {{ $.Values.credentials.existingSecret }}
      key: {{ . }}
      optional: true
{{- end }}
{{- end }}
{{- end -}}

{{- define "deltarec.launcherServiceAccountName" -}}
{{- .Values.serviceAccount.launcherName -}}
{{- end -}}
